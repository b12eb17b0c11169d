"""activate_quantize_fp8: the expert activation fused with the FP8 row quantisation.

The kernels (CPU everywhere, CUDA where there is a GPU) against the reference: a within
an ulp of the jnp activation (exp / tanh differ by platform), q and scales bitwise
quantize_fp8_rows of the returned a (evaluated on the CPU); the derivative against finite
differences of the kernel itself; shapes, vmap, sharding and errors.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import requires_gpu
from test_fp8_quantize import _reference_on, assert_bitwise, tricky

from moe_xla import reference
from moe_xla.activations import ACTIVATIONS, GATED
from moe_xla.primitives.activate_quantize_fp8 import activate_quantize_fp8

PLATFORMS = ["cpu", pytest.param("gpu", marks=requires_gpu)]
DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
# (M, F): F a multiple of 8 takes the CUDA kernel's vector accesses; tails of rows and
# columns; an empty matrix.
SHAPES = [(37, 256), (5, 300), (64, 136), (1, 7), (0, 128)]
ULP = {jnp.float32: 2.0 ** -20, jnp.bfloat16: 2.0 ** -7, jnp.float16: 2.0 ** -10}


def _h(rng, m, f, activation, dtype):
    width = 2 * f if activation in GATED else f
    h = np.asarray(rng.standard_normal((m, width)) * 3.0, np.float32)
    specials = np.array([np.nan, np.inf, -np.inf, 80.0, -80.0, 0.0, -0.0], np.float32)
    flat = h.reshape(-1)
    if flat.size:
        idx = rng.choice(flat.size, size=min(flat.size, specials.size), replace=False)
        flat[idx] = specials[: idx.size]
    return jnp.asarray(h, dtype)


def assert_near_the_reference_activation(a, h, activation):
    """a, a kernel's activation of h, within a few ulps of reference.activate_quantize_fp8's
    (evaluated on the CPU): the kernels' exp and tanh are their platform's."""
    f = a.shape[1]
    want = np.asarray(_reference_on("cpu", reference.activate_quantize_fp8, h, activation=activation)[0], np.float64)
    got = np.asarray(a, np.float64)
    # Where the reference is not finite (inf or NaN in h), neither is a: x * sigmoid(x) and
    # x / (1 + exp(-x)) disagree between inf and NaN at x = +-inf.
    finite = np.isfinite(want)
    assert np.array_equal(np.isfinite(got), finite), "finite where the reference is not (or the reverse)"
    # Relative to a, up to two roundings to the dtype; absolute, a few float32 ulps of the
    # inputs' magnitude: gelu's 1 + tanh(z) cancels for z << 0, and the platforms' tanh differ.
    h64 = np.abs(np.asarray(h, np.float64))
    with np.errstate(invalid="ignore", over="ignore"):
        size = h64[:, :f] * (h64[:, f:] if activation in GATED else 1.0)
    err = np.abs(got[finite] - want[finite])
    assert np.all(err <= 2 * ULP[h.dtype.type] * np.abs(want[finite]) + 2.0 ** -18 * size[finite]), err.max(initial=0)


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("shape", SHAPES)
def test_kernel_against_the_reference(rng, shape, activation, dtype, pow2, platform):
    h = _h(rng, *shape, activation, dtype)
    device = jax.devices(platform)[0]
    fused = functools.partial(activate_quantize_fp8, activation=activation, pow2_scale=pow2)
    a, q, scales = jax.jit(fused)(jax.device_put(h, device))
    assert a.dtype == h.dtype and a.shape == shape and q.shape == shape
    assert scales.shape == (shape[0], -(-shape[1] // 128))
    assert_near_the_reference_activation(a, h, activation)
    assert_bitwise((q, scales), _reference_on("cpu", reference.quantize_fp8_rows, jax.device_get(a), pow2_scale=pow2),
                   "quantize_fp8_rows of the returned a")


def test_kernels_number_the_activations_as_the_layer_names_them():
    """The attribute value of an activation is its index in the primitive's ACTIVATIONS
    (common/expert_activation.h); the layer's tuple must list them in that order."""
    from moe_xla.primitives import activate_quantize_fp8 as fused

    assert ACTIVATIONS == fused.ACTIVATIONS
    assert tuple(GATED) == fused.ACTIVATIONS[:2]


def test_the_primitive_is_not_differentiable(rng):
    h = jnp.asarray(rng.standard_normal((4, 512)), jnp.float32)
    with pytest.raises(TypeError, match="activate_quantize_fp8 is not differentiable"):
        jax.grad(lambda v: jnp.sum(activate_quantize_fp8(v, "swiglu")[0]))(h)


def test_leading_dims_and_vmap(rng):
    h = tricky(rng, (3, 5, 2 * 200), jnp.bfloat16)
    a, q, s = activate_quantize_fp8(h, "geglu")
    assert a.shape == (3, 5, 200) and q.shape == (3, 5, 200) and s.shape == (3, 5, 2)
    va, vq, vs = jax.vmap(lambda v: activate_quantize_fp8(v, "geglu"), in_axes=1, out_axes=1)(h)
    assert_bitwise((vq, vs), (q, s))
    np.testing.assert_array_equal(np.asarray(va, np.float32), np.asarray(a, np.float32))


@pytest.mark.parametrize("call, message", [
    (lambda: activate_quantize_fp8(jnp.zeros((4, 8)), "tanh"), "expected activation in"),
    (lambda: activate_quantize_fp8(jnp.zeros((4, 7)), "swiglu"), "odd last dim 7"),
    (lambda: activate_quantize_fp8(jnp.zeros((8,)), "relu"), "expected h of rank >= 2"),
    (lambda: activate_quantize_fp8(jnp.zeros((4, 8), jnp.int32), "relu"), "expected h of dtype"),
    (lambda: activate_quantize_fp8(jnp.zeros((4, 8)), "relu", pow2_scale=1), "pow2_scale"),
])
def test_bad_inputs_raise_at_trace_time(call, message):
    with pytest.raises((TypeError, ValueError), match=message):
        jax.eval_shape(call)


@pytest.mark.parametrize("a, activation, message", [
    (((4, 8), jnp.float16), 0, "a: expected the dtype of h"),
    (((4, 8), jnp.float32), 7, r"activation: expected 0 \.\. 4, got 7"),
    (((4, 9), jnp.float32), 0, r"a: expected shape \[4, 8\]"),
])
def test_handler_rejects_inconsistent_buffers(a, activation, message):
    from moe_xla import _lib

    results = [jax.ShapeDtypeStruct(*a), jax.ShapeDtypeStruct(a[0], jnp.float8_e4m3fn),
               jax.ShapeDtypeStruct((4, 1), jnp.float32)]
    call = jax.ffi.ffi_call(_lib.require_kernel("activate_quantize_fp8", "cpu"), results)
    with jax.default_device(jax.devices("cpu")[0]), pytest.raises(Exception, match=message):
        jax.block_until_ready(jax.jit(lambda h: call(h, activation=np.int32(activation), pow2_scale=False))(
            jnp.zeros((4, 16))))


def test_shards_along_rows_without_gathering(rng):
    if jax.device_count() < 2:
        pytest.skip("needs 2 devices")
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("d",))
    h = jax.device_put(tricky(rng, (64, 2 * 300), jnp.float32),
                       jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d")))
    f = jax.jit(lambda v: activate_quantize_fp8(v, "swiglu"))
    hlo = f.lower(h).compile().as_text()
    assert "all-gather" not in hlo and "all-to-all" not in hlo and "collective-permute" not in hlo
    out = f(h)
    assert all(o.sharding.spec[0] == "d" for o in out)
    one = jax.jit(lambda v: activate_quantize_fp8(v, "swiglu"))(jax.device_get(h))
    assert_bitwise(out[1:], one[1:])
