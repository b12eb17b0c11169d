"""activate_grad_quantize_fp8: the expert activation's backward fused with the FP8 row
quantisation of d h, and the FP8 expert MLP (fp8.gmm_activate_fp8) that runs it.

The kernels (CPU everywhere, CUDA where there is a GPU) against jax.vjp of the jnp
activation (moe_xla.activations.activate, independent of the kernels' formulas): d h
within a few ulps; q and scales bitwise quantize_fp8_rows of the returned d h (evaluated on
the CPU); gradients of gmm_activate_fp8 against the unfused FP8 path; shapes, vmap,
sharding and errors.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import requires_gpu
from test_activate_quantize_fp8 import DTYPES, PLATFORMS, SHAPES, ULP, _h
from test_fp8_quantize import _reference_on, assert_bitwise, tricky

import moe_xla
from moe_xla import fp8, reference
from moe_xla.activations import ACTIVATIONS, GATED, activate
from moe_xla.primitives.activate_grad_quantize_fp8 import activate_grad_quantize_fp8
from moe_xla.primitives.activate_quantize_fp8 import activate_quantize_fp8


def _da(rng, m, f, dtype):
    return jnp.asarray(rng.standard_normal((m, f)) * 2.0, dtype)


def _vjp_f32(h, da, activation):
    """d h of the jnp activation (XLA:CPU, float32) on the inputs' values."""
    h32, da32 = jnp.asarray(h, jnp.float32), jnp.asarray(da, jnp.float32)
    with jax.default_device(jax.devices("cpu")[0]):
        _, vjp = jax.vjp(lambda v: activate(v, activation), h32)
        return np.asarray(vjp(da32)[0], np.float64)


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("shape", SHAPES)
def test_kernel_against_the_jnp_derivative(rng, shape, activation, dtype, pow2, platform):
    m, f = shape
    h, da = _h(rng, m, f, activation, dtype), _da(rng, m, f, dtype)
    device = jax.devices(platform)[0]
    fused = functools.partial(activate_grad_quantize_fp8, activation=activation, pow2_scale=pow2)
    dh, q, scales = jax.jit(fused)(jax.device_put(h, device), jax.device_put(da, device))
    c = h.shape[1]
    assert dh.dtype == h.dtype and dh.shape == (m, c) and q.shape == (m, c) and scales.shape == (m, -(-c // 128))
    with np.errstate(invalid="ignore", over="ignore"):
        want = _vjp_f32(h, da, activation)
    got = np.asarray(dh, np.float64)
    finite = np.isfinite(want) & np.isfinite(np.asarray(h, np.float64))
    # Rows whose gate or up is not finite are left out: inf * 0 and sigmoid's limits differ
    # between formulas.
    if activation in GATED:
        finite &= np.tile(np.isfinite(np.asarray(h, np.float64)).reshape(m, 2, f).all(axis=1), 2)
    h64 = np.abs(np.asarray(h, np.float64))
    size = np.abs(np.asarray(da, np.float64))
    size = np.tile(size, 2) * (np.tile(h64[:, f:] + 1.0, 2) if activation in GATED else 1.0) if activation in GATED \
        else size * (h64 + 1.0)
    # Relative to d h, up to two roundings to the dtype (one step of its subnormals at
    # least); absolute, a few float32 ulps of the terms' magnitude (gelu' and silu' cancel).
    err = np.abs(got[finite] - want[finite])
    step = float(jnp.finfo(dtype).smallest_subnormal)
    bound = 2 * ULP[dtype] * np.abs(want[finite]) + 2.0 ** -17 * size[finite] + step
    assert np.all(err <= bound), (err - bound).max(initial=0)
    assert_bitwise((q, scales), _reference_on("cpu", reference.quantize_fp8_rows, jax.device_get(dh), pow2_scale=pow2),
                   "quantize_fp8_rows of the returned d h")


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_reference_is_the_jnp_derivative(rng, activation):
    h, da = _h(rng, 9, 136, activation, jnp.float32), _da(rng, 9, 136, jnp.float32)
    h = jnp.where(jnp.isfinite(h), h, 1.0)
    dh, q, s = reference.activate_grad_quantize_fp8(h, da, activation=activation)
    _, vjp = jax.vjp(lambda v: activate(v, activation), h)
    # The two gelu formulas' derivatives cancel near gelu's minimum: an absolute margin of a
    # few float32 ulps of |da| (up to 4) times |up| (up to 12).
    np.testing.assert_allclose(np.asarray(dh), np.asarray(vjp(da)[0]), rtol=1e-5, atol=1e-4)
    assert_bitwise((q, s), reference.quantize_fp8_rows(dh))


def _unfused_activation(h, activation):
    """activate_quantize_fp8's outputs with a differentiating as the jnp activation (XLA's
    derivative): the values of the kernel, the gradient of activations.activate."""
    a, q, s = activate_quantize_fp8(jax.lax.stop_gradient(h), activation)
    a_jnp = activate(h, activation)
    return a_jnp + jax.lax.stop_gradient(a - a_jnp), q, s


def _mlp(fused, x, w_in, w_out, sizes, activation):
    """The FP8 expert MLP, its activation through gmm_activate_fp8 (fused) or through
    gmm_fp8_blockwise and XLA's derivative of the activation (unfused)."""
    if fused:
        a, *a_q = fp8.gmm_activate_fp8(x, w_in, sizes, activation)
    else:
        a, *a_q = _unfused_activation(fp8.gmm_fp8_blockwise(x, w_in, sizes), activation)
    return fp8.gmm_fp8_blockwise(a, w_out, sizes, lhs_quantized=tuple(a_q))


def test_quantised_outputs_have_no_derivative(rng):
    x = jnp.asarray(rng.standard_normal((40, 128)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((2, 128, 256)), jnp.float32)
    sizes = jnp.asarray([30, 10], jnp.int32)
    for out in (1, 2):
        grads = jax.grad(lambda v, u, out=out: jnp.sum(
            fp8.gmm_activate_fp8(v, u, sizes, "swiglu")[out].astype(jnp.float32)), argnums=(0, 1))(x, w)
        assert all(np.all(np.asarray(g) == 0) for g in grads)


@pytest.mark.parametrize("activation", ["swiglu", "gelu", "relu"])
def test_fused_mlp_equals_the_unfused_one(rng, activation):
    """Forward bitwise; gradients those of the unfused path up to the rounding of d h (the
    fused kernel's derivative formula against XLA's), far inside FP8's own error."""
    m, k, f, g = 300, 256, 136, 3
    width = 2 * f if activation in GATED else f
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    w_in = jnp.asarray(rng.standard_normal((g, k, width)) / 16, jnp.bfloat16)
    w_out = jnp.asarray(rng.standard_normal((g, f, k)) / 12, jnp.bfloat16)
    sizes = jnp.asarray([120, 0, 150], jnp.int32)  # an empty group, rows past the last one
    ct = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    outs, grads = [], []
    for fused in (True, False):
        loss = lambda *a, fused=fused: jnp.sum(_mlp(fused, *a, sizes, activation).astype(jnp.float32) * ct)  # noqa: E731
        outs.append(np.asarray(jax.jit(lambda *a, fused=fused: _mlp(fused, *a, sizes, activation))(x, w_in, w_out),
                               np.float32))
        grads.append([np.asarray(v, np.float32) for v in jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(x, w_in, w_out)])
    np.testing.assert_array_equal(outs[0], outs[1])
    for name, a, b in zip(("x", "w_in", "w_out"), *grads):
        assert np.linalg.norm(a - b) <= 0.02 * np.linalg.norm(b), name
    np.testing.assert_array_equal(grads[0][1][1], 0.0)  # the empty group's weight gradient
    assert np.any(grads[0][1][0] != 0)


def test_the_layer_runs_the_fused_backward():
    x = jnp.ones((64, 128), jnp.bfloat16)
    logits = jnp.zeros((64, 4), jnp.float32)
    w_in, w_out = jnp.ones((4, 128, 256), jnp.bfloat16), jnp.ones((4, 128, 128), jnp.bfloat16)
    layer = functools.partial(moe_xla.moe, top_k=2, quantization="fp8_blockwise")
    hlo = jax.jit(jax.grad(lambda *a: jnp.sum(layer(*a).astype(jnp.float32)), argnums=(0, 2, 3))).lower(
        x, logits, w_in, w_out).as_text()
    assert hlo.count("moe_xla_activate_grad_quantize_fp8") == 1
    assert hlo.count("moe_xla_activate_quantize_fp8") == 1


def test_leading_dims_and_vmap(rng):
    h = tricky(rng, (3, 5, 2 * 200), jnp.bfloat16)
    da = jnp.asarray(rng.standard_normal((3, 5, 200)), jnp.bfloat16)
    dh, q, s = activate_grad_quantize_fp8(h, da, "swiglu")
    assert dh.shape == (3, 5, 400) and q.shape == (3, 5, 400) and s.shape == (3, 5, 4)
    vdh, vq, vs = jax.vmap(lambda a, b: activate_grad_quantize_fp8(a, b, "swiglu"), in_axes=1, out_axes=1)(h, da)
    assert_bitwise((vq, vs), (q, s))
    np.testing.assert_array_equal(np.asarray(vdh, np.float32), np.asarray(dh, np.float32))
    one = jax.vmap(lambda a: activate_grad_quantize_fp8(a, da[0], "swiglu"))(h)  # da not batched
    assert_bitwise(one[1:], activate_grad_quantize_fp8(h, jnp.broadcast_to(da[0], da.shape), "swiglu")[1:])


@pytest.mark.parametrize("call, message", [
    (lambda: activate_grad_quantize_fp8(jnp.zeros((4, 8)), jnp.zeros((4, 4)), "tanh"), "expected activation in"),
    (lambda: activate_grad_quantize_fp8(jnp.zeros((4, 7)), jnp.zeros((4, 3)), "swiglu"), "odd last dim 7"),
    (lambda: activate_grad_quantize_fp8(jnp.zeros((4, 8)), jnp.zeros((4, 8)), "swiglu"),
     r"expected da of shape \(4, 4\)"),
    (lambda: activate_grad_quantize_fp8(jnp.zeros((4, 8)), jnp.zeros((3, 8)), "relu"), "expected da of leading shape"),
    (lambda: activate_grad_quantize_fp8(jnp.zeros((4, 8)), jnp.zeros((4, 8), jnp.bfloat16), "relu"), "da"),
    (lambda: activate_grad_quantize_fp8(jnp.zeros((8,)), jnp.zeros((8,)), "relu"), "expected h of rank >= 2"),
])
def test_bad_inputs_raise_at_trace_time(call, message):
    with pytest.raises((TypeError, ValueError), match=message):
        jax.eval_shape(call)


def test_not_differentiable(rng):
    h = jnp.asarray(rng.standard_normal((4, 256)), jnp.float32)
    with pytest.raises(TypeError, match="activate_grad_quantize_fp8 is not differentiable"):
        jax.grad(lambda v: jnp.sum(activate_grad_quantize_fp8(v, v[:, :128], "swiglu")[0]))(h)


@pytest.mark.parametrize("da, activation, message", [
    (((4, 8), jnp.float16), 0, "da: expected the dtype of h"),
    (((4, 8), jnp.float32), 7, r"activation: expected 0 \.\. 4, got 7"),
    (((4, 9), jnp.float32), 0, r"da: expected shape \[4, 8\]"),
])
def test_handler_rejects_inconsistent_buffers(da, activation, message):
    from moe_xla import _lib

    results = [jax.ShapeDtypeStruct((4, 16), jnp.float32), jax.ShapeDtypeStruct((4, 16), jnp.float8_e4m3fn),
               jax.ShapeDtypeStruct((4, 1), jnp.float32)]
    call = jax.ffi.ffi_call(_lib.require_kernel("activate_grad_quantize_fp8", "cpu"), results)
    with jax.default_device(jax.devices("cpu")[0]), pytest.raises(Exception, match=message):
        jax.block_until_ready(jax.jit(lambda h, d: call(h, d, activation=np.int32(activation), pow2_scale=False))(
            jnp.zeros((4, 16)), jnp.zeros(*da)))


def test_shards_along_rows_without_gathering(rng):
    if jax.device_count() < 2:
        pytest.skip("needs 2 devices")
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("d",))
    rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d"))
    h = jax.device_put(tricky(rng, (64, 2 * 300), jnp.float32), rows)
    da = jax.device_put(jnp.asarray(rng.standard_normal((64, 300)), jnp.float32), rows)
    f = jax.jit(lambda a, b: activate_grad_quantize_fp8(a, b, "swiglu"))
    hlo = f.lower(h, da).compile().as_text()
    assert "all-gather" not in hlo and "all-to-all" not in hlo and "collective-permute" not in hlo
    out = f(h, da)
    assert all(o.sharding.spec[0] == "d" for o in out)
    one = f(jax.device_get(h), jax.device_get(da))
    assert_bitwise(out[1:], one[1:])


@requires_gpu
def test_gpu_memcheck_shapes_run(rng):
    """Tails in both dimensions and F % 8 != 0 (the element-wise path) on the GPU."""
    for m, f in ((3, 13), (130, 260)):
        h, da = _h(rng, m, f, "swiglu", jnp.bfloat16), _da(rng, m, f, jnp.bfloat16)
        dh, q, s = jax.jit(lambda a, b: activate_grad_quantize_fp8(a, b, "swiglu"))(
            jax.device_put(h, jax.devices("gpu")[0]), jax.device_put(da, jax.devices("gpu")[0]))
        cpu = jax.jit(lambda a, b: activate_grad_quantize_fp8(a, b, "swiglu"))(h, da)
        np.testing.assert_allclose(np.asarray(dh, np.float32), np.asarray(cpu[0], np.float32), rtol=2 ** -6, atol=1e-6)
