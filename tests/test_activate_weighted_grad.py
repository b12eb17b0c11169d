"""activate_weighted_grad: the backward of the routing-weighted expert activation in one
pass, and activate_weighted_tangent, the linear primitive it transposes.

The kernels (CPU everywhere, CUDA where there is a GPU) against jax.vjp of the activation
of tests/independent.py (its own formulas, not the library's): d h within a few ulps;
d omega on the CPU against the sum of g times the a the CPU's FP8 activation kernel
returns (the same activate() of common/expert_activation.h, so only the summation order
differs), on the GPU within a rounding of a. The tangent primitive's transpose, forward
mode, second order, vmap, sharding along rows and errors.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import requires_gpu
from independent import activation_fn
from test_activate_quantize_fp8 import DTYPES, PLATFORMS, SHAPES, ULP, _h
from test_fp8_quantize import tricky

from moe_xla import reference
from moe_xla.activations import ACTIVATIONS, GATED, weighted_tangent
from moe_xla.primitives.activate_quantize_fp8 import activate_quantize_fp8
from moe_xla.primitives.activate_weighted_grad import activate_weighted_grad, formula
from moe_xla.primitives.activate_weighted_tangent import activate_weighted_tangent


def _g(rng, m, f, dtype):
    return jnp.asarray(rng.standard_normal((m, f)) * 2.0, dtype)


def _omega(rng, m):
    """Routing weights in [0, 1], a zero among them (a row no entry names)."""
    omega = rng.uniform(0.0, 1.0, m).astype(np.float32)
    omega[: min(m, 1)] = 0.0
    return jnp.asarray(omega)


def _vjp_f64(h, g, omega, activation):
    """d h of sum(omega * act(h) * g), act the independent formulas, in float64 on the CPU."""
    with jax.default_device(jax.devices("cpu")[0]), jax.enable_x64(True):
        h64 = jnp.asarray(np.asarray(h, np.float64))
        da = jnp.asarray(np.asarray(omega, np.float64)[:, None] * np.asarray(g, np.float64))
        if activation == "relu":  # jax.nn.relu's rule: 0 at h = 0 (a maximum's vjp splits there)
            return np.where(np.asarray(h64) > 0, np.asarray(da), 0.0)
        _, vjp = jax.vjp(activation_fn(activation), h64)
        return np.asarray(vjp(da)[0])


def _finite_rows(h, activation, f):
    """Elements of d h whose row's gate and up (or h) are finite at that column."""
    ok = np.isfinite(np.asarray(h, np.float64))
    if activation in GATED:
        return np.tile(ok.reshape(ok.shape[0], 2, f).all(axis=1), 2)
    return ok


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the NaN and inf inputs of _h, by design
@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("shape", SHAPES)
def test_kernel_against_the_derivative(rng, shape, activation, dtype, platform):
    m, f = shape
    h, g, omega = _h(rng, m, f, activation, dtype), _g(rng, m, f, dtype), _omega(rng, m)
    device = jax.devices(platform)[0]
    dh, d_omega = jax.jit(activate_weighted_grad, static_argnums=3)(
        *(jax.device_put(v, device) for v in (h, g, omega)), activation)
    c = h.shape[1]
    assert dh.dtype == h.dtype and dh.shape == (m, c) and d_omega.dtype == jnp.float32 and d_omega.shape == (m,)

    with np.errstate(invalid="ignore", over="ignore"):
        want = _vjp_f64(h, g, omega, activation)
    got = np.asarray(dh, np.float64)
    finite = _finite_rows(h, activation, f) & np.isfinite(want)
    h64 = np.abs(np.asarray(h, np.float64))
    da = np.abs(np.asarray(omega, np.float64)[:, None] * np.asarray(g, np.float64))
    size = np.tile(da, 2) * np.tile(h64[:, f:] + 1.0, 2) if activation in GATED else da * (h64 + 1.0)
    # Relative to d h, one rounding to the dtype (half its spacing; omega * g is not
    # rounded first), one step of its subnormals; absolute, a few float32 ulps of the terms'
    # magnitude (gelu' and silu' cancel).
    err = np.abs(got[finite] - want[finite])
    bound = 0.5 * ULP[dtype] * np.abs(want[finite]) + 2.0 ** -17 * size[finite] + float(
        jnp.finfo(dtype).smallest_subnormal)
    assert np.all(err <= bound), (err - bound).max(initial=0)

    # d omega = <g, a> with a the activation rounded to the dtype. On the CPU the FP8
    # activation kernel returns the same a (common/expert_activation.h's activate()).
    with jax.default_device(jax.devices("cpu")[0]):
        a_cpu = np.asarray(activate_quantize_fp8(jax.device_put(h, jax.devices("cpu")[0]), activation)[0], np.float64)
    terms = np.asarray(g, np.float64) * a_cpu
    rows = np.isfinite(terms).all(axis=1)
    want_omega = terms.sum(axis=1)
    scale = np.abs(terms).sum(axis=1)
    # float32 summation: F ulps of the terms' sum; elsewhere than the CPU, a may round one
    # element differently (its exp and tanh): one ulp of the dtype of the largest term.
    slack = 0.0 if platform == "cpu" else 2 * ULP[dtype] * np.abs(terms).max(axis=1, initial=0.0)
    bound = f * 2.0 ** -23 * scale + slack + 1e-30
    err = np.abs(np.asarray(d_omega, np.float64) - want_omega)
    assert np.all(err[rows] <= bound[rows]), (err - bound)[rows].max(initial=0)


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_reference_and_formula_are_the_derivative(rng, activation):
    h, g = _h(rng, 9, 136, activation, jnp.float32), _g(rng, 9, 136, jnp.float32)
    h = jnp.where(jnp.isfinite(h), h, 1.0)
    omega = _omega(rng, 9)
    want = _vjp_f64(h, g, omega, activation)
    a = np.asarray(activation_fn(activation)(np.asarray(h, np.float64)), np.float32).astype(np.float64)
    for dh, d_omega in (reference.activate_weighted_grad(h, g, omega, activation=activation),
                        jax.jit(formula, static_argnums=3)(h, g, omega, activation)):
        np.testing.assert_allclose(np.asarray(dh), want, rtol=1e-5, atol=1e-4)
        np.testing.assert_allclose(np.asarray(d_omega), (np.asarray(g, np.float64) * a).sum(axis=1), rtol=1e-5,
                                   atol=1e-4)


def _tangent_inputs(rng, m=21, f=24, activation="swiglu", dtype=jnp.float32):
    h = jnp.asarray(rng.standard_normal((m, 2 * f if activation in GATED else f)), dtype)
    return h, _omega(rng, m), jnp.asarray(rng.standard_normal(h.shape), dtype), jnp.asarray(
        rng.standard_normal(m), jnp.float32)


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_tangent_is_the_formula_and_transposes_to_the_kernel(rng, activation, dtype):
    h, omega, d_h, d_omega = _tangent_inputs(rng, activation=activation, dtype=dtype)
    prim = jax.jit(activate_weighted_tangent, static_argnums=4)(h, omega, d_h, d_omega, activation)
    np.testing.assert_array_equal(np.asarray(prim, np.float32), np.asarray(
        jax.jit(weighted_tangent, static_argnums=4)(h, omega, d_h, d_omega, activation), np.float32))
    ct = jnp.asarray(rng.standard_normal(prim.shape), dtype)
    linear = lambda a, b: activate_weighted_tangent(h, omega, a, b, activation)  # noqa: E731
    got = jax.jit(lambda c: jax.linear_transpose(linear, d_h, d_omega)(c))(ct)
    want = activate_weighted_grad(h, ct, omega, activation)
    for x, y in zip(got, want):
        np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))
    # The transpose of the jnp formula agrees within its roundings.
    ref = jax.linear_transpose(lambda a, b: weighted_tangent(h, omega, a, b, activation), d_h, d_omega)(ct)
    tol = 1e-5 if dtype == jnp.float32 else 2.0 ** -7
    for x, y in zip(got, ref):
        np.testing.assert_allclose(np.asarray(x, np.float32), np.asarray(y, np.float32), rtol=tol, atol=tol)


def test_only_one_of_the_tangents_is_differentiated(rng):
    h, omega, d_h, d_omega = _tangent_inputs(rng)
    ct = jnp.asarray(rng.standard_normal((h.shape[0], h.shape[1] // 2)), jnp.float32)
    want_h, want_omega = activate_weighted_grad(h, ct, omega, "swiglu")
    got_h = jax.linear_transpose(lambda a: activate_weighted_tangent(h, omega, a, jnp.zeros_like(d_omega), "swiglu"),
                                 d_h)(ct)[0]
    got_omega = jax.linear_transpose(lambda b: activate_weighted_tangent(h, omega, jnp.zeros_like(d_h), b, "swiglu"),
                                     d_omega)(ct)[0]
    np.testing.assert_array_equal(np.asarray(got_h), np.asarray(want_h))
    np.testing.assert_array_equal(np.asarray(got_omega), np.asarray(want_omega))


def test_derivatives_in_the_point_are_the_formulas(rng):
    """jvp of both primitives in every operand (h and omega included: second order) equals
    the jvp of their jnp formulas."""
    h, omega, d_h, d_omega = _tangent_inputs(rng, activation="geglu")
    ts = [jnp.asarray(rng.standard_normal(v.shape), v.dtype) for v in (h, omega, d_h, d_omega)]
    got = jax.jvp(lambda *a: activate_weighted_tangent(*a, "geglu"), (h, omega, d_h, d_omega), tuple(ts))[1]
    want = jax.jvp(lambda *a: weighted_tangent(*a, "geglu"), (h, omega, d_h, d_omega), tuple(ts))[1]
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)
    g = jnp.asarray(rng.standard_normal((h.shape[0], h.shape[1] // 2)), jnp.float32)
    tg = (ts[0], jnp.asarray(rng.standard_normal(g.shape), jnp.float32), ts[1])
    got = jax.jvp(lambda *a: activate_weighted_grad(*a, "geglu"), (h, g, omega), tg)[1]
    want = jax.jvp(lambda *a: formula(*a, "geglu"), (h, g, omega), tg)[1]
    for x, y in zip(got, want):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-5)


def test_vmap_folds_into_rows(rng):
    h = tricky(rng, (3, 5, 2 * 40), jnp.bfloat16)
    g = jnp.asarray(rng.standard_normal((3, 5, 40)), jnp.bfloat16)
    omega = jnp.asarray(rng.uniform(size=(3, 5)), jnp.float32)
    got = jax.vmap(lambda a, b, c: activate_weighted_grad(a, b, c, "swiglu"), in_axes=(1, 1, 1), out_axes=1)(
        h, g, omega)
    want = activate_weighted_grad(h.reshape(15, 80), g.reshape(15, 40), omega.reshape(15), "swiglu")
    np.testing.assert_array_equal(np.asarray(got[0], np.float32).reshape(15, 80), np.asarray(want[0], np.float32))
    np.testing.assert_array_equal(np.asarray(got[1]).reshape(15), np.asarray(want[1]))
    shared = jax.vmap(lambda a: activate_weighted_grad(a, g[0], omega[0], "swiglu"))(h)  # g, omega not batched
    np.testing.assert_array_equal(np.asarray(shared[1]), np.asarray(activate_weighted_grad(
        h.reshape(15, 80), jnp.tile(g[0], (3, 1)), jnp.tile(omega[0], 3), "swiglu")[1]).reshape(3, 5))


@pytest.mark.parametrize("call, message", [
    (lambda: activate_weighted_grad(jnp.zeros((4, 8)), jnp.zeros((4, 4)), jnp.zeros(4), "tanh"),
     "expected activation in"),
    (lambda: activate_weighted_grad(jnp.zeros((4, 7)), jnp.zeros((4, 3)), jnp.zeros(4), "swiglu"), "odd last dim 7"),
    (lambda: activate_weighted_grad(jnp.zeros((4, 8)), jnp.zeros((4, 8)), jnp.zeros(4), "swiglu"),
     r"expected g of shape \(4, 4\)"),
    (lambda: activate_weighted_grad(jnp.zeros((4, 8)), jnp.zeros((4, 8), jnp.bfloat16), jnp.zeros(4), "relu"), "g"),
    (lambda: activate_weighted_grad(jnp.zeros((4, 8)), jnp.zeros((4, 8)), jnp.zeros(4, jnp.bfloat16), "relu"),
     "expected float32 omega"),
    (lambda: activate_weighted_grad(jnp.zeros((4, 8)), jnp.zeros((4, 8)), jnp.zeros(3), "relu"),
     r"expected omega of shape \(4,\)"),
    (lambda: activate_weighted_grad(jnp.zeros((8,)), jnp.zeros((8,)), jnp.zeros(8), "relu"), "expected h of rank 2"),
    (lambda: activate_weighted_tangent(jnp.zeros((4, 8)), jnp.zeros(4), jnp.zeros((4, 6)), jnp.zeros(4), "relu"),
     r"expected d_h of h's shape"),
    (lambda: activate_weighted_tangent(jnp.zeros((4, 8)), jnp.zeros(4), jnp.zeros((4, 8)), jnp.zeros(5), "relu"),
     "d_omega float32"),
])
def test_bad_inputs_raise_at_trace_time(call, message):
    with pytest.raises((TypeError, ValueError), match=message):
        jax.eval_shape(call)


@pytest.mark.parametrize("g, omega, activation, message", [
    (((4, 8), jnp.float16), (4,), 0, "g: expected the dtype of h"),
    (((4, 8), jnp.float32), (4,), 7, r"activation: expected 0 \.\. 4, got 7"),
    (((4, 9), jnp.float32), (4,), 0, r"g: expected shape \[4, 8\]"),
    (((4, 8), jnp.float32), (5,), 0, r"omega: expected shape \[4\]"),
])
def test_handler_rejects_inconsistent_buffers(g, omega, activation, message):
    from moe_xla import _lib

    results = [jax.ShapeDtypeStruct((4, 16), jnp.float32), jax.ShapeDtypeStruct((4,), jnp.float32)]
    call = jax.ffi.ffi_call(_lib.require_kernel("activate_weighted_grad", "cpu"), results)
    with jax.default_device(jax.devices("cpu")[0]), pytest.raises(Exception, match=message):
        jax.block_until_ready(jax.jit(lambda h, a, b: call(h, a, b, activation=np.int32(activation)))(
            jnp.zeros((4, 16)), jnp.zeros(*g), jnp.zeros(omega, jnp.float32)))


def test_shards_along_rows_without_gathering(rng):
    if jax.device_count() < 2:
        pytest.skip("needs 2 devices")
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("d",))
    rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d"))
    h = jax.device_put(tricky(rng, (64, 2 * 300), jnp.float32), rows)
    g = jax.device_put(jnp.asarray(rng.standard_normal((64, 300)), jnp.float32), rows)
    omega = jax.device_put(jnp.asarray(rng.uniform(size=64), jnp.float32), rows)
    f = jax.jit(lambda *a: activate_weighted_grad(*a, "swiglu"))
    hlo = f.lower(h, g, omega).compile().as_text()
    assert "all-gather" not in hlo and "all-to-all" not in hlo and "collective-permute" not in hlo
    out = f(h, g, omega)
    assert all(o.sharding.spec[0] == "d" for o in out)
    one = f(*(jax.device_get(v) for v in (h, g, omega)))
    for x, y in zip(out, one):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@requires_gpu
def test_gpu_memcheck_shapes_run(rng):
    """Tails in both dimensions and F % 8 != 0 (the element-wise path) on the GPU, against
    the CPU kernel."""
    gpu, cpu = jax.devices("gpu")[0], jax.devices("cpu")[0]
    for m, f in ((3, 13), (130, 260), (9, 1032)):
        args = (_h(rng, m, f, "swiglu", jnp.bfloat16), _g(rng, m, f, jnp.bfloat16), _omega(rng, m))
        run = jax.jit(lambda *a: activate_weighted_grad(*a, "swiglu"))
        on_gpu = run(*(jax.device_put(v, gpu) for v in args))
        on_cpu = run(*(jax.device_put(v, cpu) for v in args))
        for x, y in zip(on_gpu, on_cpu):
            x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
            ok = np.isfinite(y)
            np.testing.assert_allclose(x[ok], y[ok], rtol=2 ** -6, atol=1e-5)
