"""activate_grad_quantize_fp8: the routing-weighted expert activation's backward fused with
the FP8 row quantisation of d h, and the FP8 expert MLP (fp8.gmm_activate_fp8) that runs it.

The kernels (CPU everywhere, CUDA where there is a GPU) against jax.vjp of the jnp
activation (moe_xla.activations.activate, independent of the kernels' formulas) at
da = omega * g: d h within a few ulps; d omega against <g, act(h)> in float64; q and
scales bitwise quantize_fp8_rows of the returned d h (evaluated on the CPU); gradients of
gmm_activate_fp8 against the unfused FP8 path; shapes, vmap, sharding and errors.
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


def _omega(rng, m):
    """Routing weights in (0, 1], a zero and a one among them."""
    omega = rng.uniform(0.0, 1.0, m).astype(np.float32)
    omega[: min(m, 2)] = [0.0, 1.0][: min(m, 2)]
    return jnp.asarray(omega)


def _ones(m):
    return jnp.ones((m,), jnp.float32)


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
    h, g, omega = _h(rng, m, f, activation, dtype), _da(rng, m, f, dtype), _omega(rng, m)
    device = jax.devices(platform)[0]
    fused = functools.partial(activate_grad_quantize_fp8, activation=activation, pow2_scale=pow2)
    dh, q, scales, d_omega = jax.jit(fused)(*(jax.device_put(v, device) for v in (h, g, omega)))
    c = h.shape[1]
    assert dh.dtype == h.dtype and dh.shape == (m, c) and q.shape == (m, c) and scales.shape == (m, -(-c // 128))
    assert d_omega.shape == (m,) and d_omega.dtype == jnp.float32
    da = np.asarray(omega)[:, None] * np.asarray(g, np.float32)  # float32, as the kernels form it
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
    with np.errstate(invalid="ignore"):  # 0 * inf on rows left out
        size = np.tile(size, 2) * (np.tile(h64[:, f:] + 1.0, 2) if activation in GATED else 1.0) \
            if activation in GATED else size * (h64 + 1.0)
    # Relative to d h, up to two roundings to the dtype (one step of its subnormals at
    # least); absolute, a few float32 ulps of the terms' magnitude (gelu' and silu' cancel).
    err = np.abs(got[finite] - want[finite])
    step = float(jnp.finfo(dtype).smallest_subnormal)
    bound = 2 * ULP[dtype] * np.abs(want[finite]) + 2.0 ** -17 * size[finite] + step
    assert np.all(err <= bound), (err - bound).max(initial=0)
    assert_bitwise((q, scales), _reference_on("cpu", reference.quantize_fp8_rows, jax.device_get(dh), pow2_scale=pow2),
                   "quantize_fp8_rows of the returned d h")
    # d omega = <g, a>, a = act(h) rounded to the dtype (an ulp of it apart between the
    # platforms' exp / tanh), on rows with a finite h.
    with jax.default_device(jax.devices("cpu")[0]), np.errstate(invalid="ignore", over="ignore"):
        a = np.asarray(activate(jnp.asarray(h), activation), np.float64)
        products = np.asarray(g, np.float64) * a
        rows = np.isfinite(np.asarray(h, np.float64)).all(axis=1) & np.isfinite(products).all(axis=1)
        want_dot = products.sum(axis=1)
        bound_dot = (2 * ULP[dtype] + 2.0 ** -20) * np.abs(products).sum(axis=1) + 1e-30
    assert np.all(np.abs(np.asarray(d_omega, np.float64)[rows] - want_dot[rows]) <= bound_dot[rows])


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_reference_is_the_jnp_derivative(rng, activation):
    h, g, omega = _h(rng, 9, 300, activation, jnp.float32), _da(rng, 9, 300, jnp.float32), _omega(rng, 9)
    h = jnp.where(jnp.isfinite(h), h, 1.0)
    dh, q, s, d_omega_tiles = reference.activate_grad_quantize_fp8(h, g, omega, activation=activation)
    # The weighted activation's vjp in (h, omega), independent of the reference's formula.
    _, vjp = jax.vjp(lambda v, w: w[:, None] * activate(v, activation), h, omega)
    want_dh, want_omega = vjp(g)
    # The two gelu formulas' derivatives cancel near gelu's minimum: an absolute margin of a
    # few float32 ulps of |da| (up to 4) times |up| (up to 12).
    np.testing.assert_allclose(np.asarray(dh), np.asarray(want_dh), rtol=1e-5, atol=1e-4)
    assert_bitwise((q, s), reference.quantize_fp8_rows(dh))
    assert d_omega_tiles.shape == (9, 3)  # tiles of F = 300: 128, 128, 44
    np.testing.assert_allclose(np.asarray(d_omega_tiles).sum(axis=1), np.asarray(want_omega), rtol=1e-5, atol=1e-4)
    tail = np.sum(np.asarray(g)[:, 256:] * np.asarray(activate(h, activation))[:, 256:], axis=1)
    np.testing.assert_allclose(np.asarray(d_omega_tiles)[:, 2], tail, rtol=1e-5, atol=1e-5)


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
    g = jnp.asarray(rng.standard_normal((3, 5, 200)), jnp.bfloat16)
    omega = jnp.asarray(rng.uniform(size=(3, 5)), jnp.float32)
    dh, q, s, d_omega = activate_grad_quantize_fp8(h, g, omega, "swiglu")
    assert dh.shape == (3, 5, 400) and q.shape == (3, 5, 400) and s.shape == (3, 5, 4) and d_omega.shape == (3, 5)
    out = jax.vmap(lambda a, b, w: activate_grad_quantize_fp8(a, b, w, "swiglu"), in_axes=1, out_axes=1)(h, g, omega)
    assert_bitwise(out[1:3], (q, s))
    for got, want in ((out[0], dh), (out[3], d_omega)):
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    one = jax.vmap(lambda a, w: activate_grad_quantize_fp8(a, g[0], w, "swiglu"))(h, omega)  # g not batched
    assert_bitwise(one[1:3], activate_grad_quantize_fp8(h, jnp.broadcast_to(g[0], g.shape), omega, "swiglu")[1:3])


@pytest.mark.parametrize("call, message", [
    (lambda: activate_grad_quantize_fp8(jnp.zeros((4, 8)), jnp.zeros((4, 4)), _ones(4), "tanh"),
     "expected activation in"),
    (lambda: activate_grad_quantize_fp8(jnp.zeros((4, 7)), jnp.zeros((4, 3)), _ones(4), "swiglu"), "odd last dim 7"),
    (lambda: activate_grad_quantize_fp8(jnp.zeros((4, 8)), jnp.zeros((4, 8)), _ones(4), "swiglu"),
     r"expected g of shape \(4, 4\)"),
    (lambda: activate_grad_quantize_fp8(jnp.zeros((4, 8)), jnp.zeros((3, 8)), _ones(4), "relu"),
     "expected g of leading shape"),
    (lambda: activate_grad_quantize_fp8(jnp.zeros((4, 8)), jnp.zeros((4, 8), jnp.bfloat16), _ones(4), "relu"), "g"),
    (lambda: activate_grad_quantize_fp8(jnp.zeros((4, 8)), jnp.zeros((4, 8)), _ones(3), "relu"),
     r"expected omega of shape \(4,\)"),
    (lambda: activate_grad_quantize_fp8(jnp.zeros((4, 8)), jnp.zeros((4, 8)), jnp.ones(4, jnp.bfloat16), "relu"),
     "expected float32 omega"),
    (lambda: activate_grad_quantize_fp8(jnp.zeros((8,)), jnp.zeros((8,)), _ones(1), "relu"),
     "expected h of rank >= 2"),
])
def test_bad_inputs_raise_at_trace_time(call, message):
    with pytest.raises((TypeError, ValueError), match=message):
        jax.eval_shape(call)


def test_not_differentiable(rng):
    h = jnp.asarray(rng.standard_normal((4, 256)), jnp.float32)
    with pytest.raises(TypeError, match="activate_grad_quantize_fp8 is not differentiable"):
        jax.grad(lambda v: jnp.sum(activate_grad_quantize_fp8(v, v[:, :128], _ones(4), "swiglu")[0]))(h)


@pytest.mark.parametrize("g, omega, activation, message", [
    (((4, 8), jnp.float16), 4, 0, "g: expected the dtype of h"),
    (((4, 8), jnp.float32), 4, 7, r"activation: expected 0 \.\. 4, got 7"),
    (((4, 9), jnp.float32), 4, 0, r"g: expected shape \[4, 8\]"),
    (((4, 8), jnp.float32), 5, 0, r"omega: expected shape \[4\]"),
])
def test_handler_rejects_inconsistent_buffers(g, omega, activation, message):
    from moe_xla import _lib

    results = [jax.ShapeDtypeStruct((4, 16), jnp.float32), jax.ShapeDtypeStruct((4, 16), jnp.float8_e4m3fn),
               jax.ShapeDtypeStruct((4, 1), jnp.float32), jax.ShapeDtypeStruct((4, 1), jnp.float32)]
    call = jax.ffi.ffi_call(_lib.require_kernel("activate_grad_quantize_fp8", "cpu"), results)
    with jax.default_device(jax.devices("cpu")[0]), pytest.raises(Exception, match=message):
        jax.block_until_ready(jax.jit(lambda h, d, w: call(h, d, w, activation=np.int32(activation),
                                                            pow2_scale=False))(
            jnp.zeros((4, 16)), jnp.zeros(*g), jnp.ones((omega,), jnp.float32)))


def test_shards_along_rows_without_gathering(rng):
    if jax.device_count() < 2:
        pytest.skip("needs 2 devices")
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("d",))
    rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d"))
    h = jax.device_put(tricky(rng, (64, 2 * 300), jnp.float32), rows)
    g = jax.device_put(jnp.asarray(rng.standard_normal((64, 300)), jnp.float32), rows)
    omega = jax.device_put(_omega(rng, 64), rows)
    f = jax.jit(lambda a, b, w: activate_grad_quantize_fp8(a, b, w, "swiglu"))
    hlo = f.lower(h, g, omega).compile().as_text()
    assert "all-gather" not in hlo and "all-to-all" not in hlo and "collective-permute" not in hlo
    out = f(h, g, omega)
    assert all(o.sharding.spec[0] == "d" for o in out)
    one = f(*(jax.device_get(v) for v in (h, g, omega)))
    assert_bitwise(out[1:3], one[1:3])
    np.testing.assert_array_equal(np.asarray(out[3]), np.asarray(one[3]))


@requires_gpu
def test_gpu_memcheck_shapes_run(rng):
    """Tails in both dimensions and F % 8 != 0 (the element-wise path) on the GPU."""
    for m, f in ((3, 13), (130, 260), (70, 256)):
        args = (_h(rng, m, f, "swiglu", jnp.bfloat16), _da(rng, m, f, jnp.bfloat16), _omega(rng, m))
        fused = jax.jit(lambda a, b, w: activate_grad_quantize_fp8(a, b, w, "swiglu"))
        gpu = fused(*(jax.device_put(v, jax.devices("gpu")[0]) for v in args))
        cpu = fused(*(jax.device_put(v, jax.devices("cpu")[0]) for v in args))
        np.testing.assert_allclose(np.asarray(gpu[0], np.float32), np.asarray(cpu[0], np.float32), rtol=2 ** -6, atol=1e-6)
