"""moe()'s gathered forward with the activation in the first product's epilogue
(experts._fused_forward_mlp, chosen by experts.fused_activation): its values against the
unfused path and the reference, its gradients (the unfused path's rule, so bitwise those of
the unfused program), and which primitive each program runs; on a Hopper GPU, that "auto"
takes the fused kernel where it applies.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ON_GPU, assert_close, normal

import moe_xla
import moe_xla._lib as _lib
from moe_xla import experts, first_product, reference

T, H, E, TOP_K = 70, 16, 6, 3


def _args(rng, dtype, f, activation):
    x = normal(rng, (T, H), dtype)
    logits = normal(rng, (T, E), jnp.float32)
    n = 2 * f if activation in ("swiglu", "geglu") else f
    w_in = (normal(rng, (E, H, n), jnp.float32) / np.sqrt(H)).astype(dtype)
    w_out = (normal(rng, (E, f, H), jnp.float32) / np.sqrt(f)).astype(dtype)
    return x, logits, w_in, w_out


def _run(fusion, args, activation):
    """(y, grads w.r.t. x, logits, w_in, w_out, forward jaxpr text, step jaxpr text) of moe()
    with its first product gathered and its activation's fusion forced to `fusion`."""
    ct = jnp.cos(jnp.arange(args[0].size, dtype=jnp.float32).reshape(args[0].shape))
    layer = lambda *a: moe_xla.moe(*a, top_k=TOP_K, activation=activation)  # noqa: E731
    step = jax.grad(lambda *a: jnp.sum(layer(*a).astype(jnp.float32) * ct), (0, 1, 2, 3))
    with first_product.forced("gather"), experts.fused_activation(fusion):
        y = jax.jit(layer)(*args)
        grads = jax.jit(step)(*args)
        texts = str(jax.make_jaxpr(layer)(*args)), str(jax.make_jaxpr(step)(*args))
    return y, grads, *texts


@pytest.mark.parametrize("activation,f", [("swiglu", 128), ("geglu", 8), ("gelu", 24), ("silu", 8), ("relu", 16)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_fused_forward_equals_unfused_and_differentiates_as_it(rng, activation, f, dtype):
    args = _args(rng, dtype, f, activation)
    y_f, g_f, fwd_f, step_f = _run("fused", args, activation)
    y_u, g_u, fwd_u, step_u = _run("unfused", args, activation)
    assert "moe_xla_gather_gmm_activate" in fwd_f and "moe_xla_gather_gmm_activate" not in fwd_u
    # Differentiated, the fused forward is the unfused path: same program, same gradients.
    assert "moe_xla_gather_gmm_activate" not in step_f
    for a, b in zip(g_f, g_u):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    assert y_f.dtype == y_u.dtype == dtype
    # Forward: they differ by the rounding of h to the layer's dtype (none in float32).
    if jnp.dtype(dtype) == jnp.float32 and not ON_GPU:
        np.testing.assert_array_equal(np.asarray(y_f), np.asarray(y_u))
    else:
        assert_close(y_f, y_u, dtype)
    assert_close(y_f, reference.moe(*args, top_k=TOP_K, activation=activation), dtype)


def test_fused_activation_takes_known_modes():
    with pytest.raises(ValueError, match="expected a mode in"):
        with experts.fused_activation("gather"):
            pass


@pytest.mark.skipif(not (ON_GPU and _lib.has_kernel("gather_gmm_activate", "cuda") and _lib.local_gpus_hopper()),
                    reason="needs the fused kernel on a Hopper GPU")
@pytest.mark.parametrize("activation,f,fuses", [("swiglu", 128, True), ("gelu", 24, True), ("swiglu", 8, False)])
def test_auto_fuses_on_hopper_where_the_kernel_applies(rng, activation, f, fuses):
    args = _args(rng, jnp.bfloat16, f, activation)
    layer = jax.jit(lambda *a: moe_xla.moe(*a, top_k=TOP_K, activation=activation))
    with first_product.forced("gather"):
        hlo = layer.lower(*args).compile().as_text()
        y = layer(*args)
    assert ('custom_call_target="moe_xla_gather_gmm_activate_cuda_v1"' in hlo) is fuses
    assert_close(y, reference.moe(*args, top_k=TOP_K, activation=activation), jnp.bfloat16)
