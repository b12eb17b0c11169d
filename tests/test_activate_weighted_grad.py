"""activate_weighted_grad: the backward of the routing-weighted expert activation in one
pass, with the weighted activation b = omega * a beside it in g's buffer.

The kernels (CPU everywhere, CUDA where there is a GPU) against jax.vjp of the activation
of tests/independent.py (its own formulas, not the library's): d h within a few ulps;
d omega and b on the CPU against the a the CPU's FP8 activation kernel returns (the same
activate() of common/expert_activation.h, so only d omega's summation order differs), on
the GPU within a rounding of a. The alias of g and b, forward mode (second order), vmap,
sharding along rows and errors. The linear primitive whose transpose binds it
(primitives/activate_gmm_combine_tangent) is tested through moe()'s second product in
tests/test_product_combine.py.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import requires_gpu
from independent import activation_fn
from test_activate_quantize_fp8 import DTYPES, PLATFORMS, SHAPES, ULP, _h
from test_fp8_quantize import tricky

from moe_xla import reference
from moe_xla.activations import ACTIVATIONS, GATED
from moe_xla.primitives.activate_quantize_fp8 import activate_quantize_fp8
from moe_xla.primitives.activate_weighted_grad import activate_weighted_grad, formula


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
    dh, d_omega, b = jax.jit(activate_weighted_grad, static_argnums=3)(
        *(jax.device_put(v, device) for v in (h, g, omega)), activation)
    c = h.shape[1]
    assert dh.dtype == h.dtype and dh.shape == (m, c) and d_omega.dtype == jnp.float32 and d_omega.shape == (m,)
    assert b.dtype == h.dtype and b.shape == (m, f)

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

    # b = omega * a rounded to the dtype: on the CPU bitwise that of the CPU's a; elsewhere
    # within omega times a's error (two roundings of a to the dtype, and gelu's 1 + tanh(z)
    # cancelling for z << 0, as test_activate_quantize_fp8 allows) and one rounding of b.
    omega64 = np.asarray(omega, np.float64)[:, None]
    want_b = np.asarray(jnp.asarray(omega64 * a_cpu, jnp.float32).astype(dtype), np.float64)
    got_b = np.asarray(b, np.float64)
    if platform == "cpu":
        np.testing.assert_array_equal(got_b, want_b)
    else:
        ok = np.isfinite(want_b)
        with np.errstate(invalid="ignore", over="ignore"):
            size = h64[:, :f] * (h64[:, f:] if activation in GATED else 1.0)
        bound = (omega64 * (2 * ULP[dtype] * np.abs(a_cpu) + 2.0 ** -18 * size) + ULP[dtype] * np.abs(want_b)
                 + float(jnp.finfo(dtype).smallest_subnormal))
        assert np.all(np.abs(got_b - want_b)[ok] <= bound[ok]), (np.abs(got_b - want_b) - bound)[ok].max(initial=0)


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_reference_and_formula_are_the_derivative(rng, activation):
    h, g = _h(rng, 9, 136, activation, jnp.float32), _g(rng, 9, 136, jnp.float32)
    h = jnp.where(jnp.isfinite(h), h, 1.0)
    omega = _omega(rng, 9)
    want = _vjp_f64(h, g, omega, activation)
    a = np.asarray(activation_fn(activation)(np.asarray(h, np.float64)), np.float32).astype(np.float64)
    for dh, d_omega, b in (reference.activate_weighted_grad(h, g, omega, activation=activation),
                           jax.jit(formula, static_argnums=3)(h, g, omega, activation)):
        np.testing.assert_allclose(np.asarray(dh), want, rtol=1e-5, atol=1e-4)
        np.testing.assert_allclose(np.asarray(d_omega), (np.asarray(g, np.float64) * a).sum(axis=1), rtol=1e-5,
                                   atol=1e-4)
        np.testing.assert_allclose(np.asarray(b), np.asarray(omega, np.float64)[:, None] * a, rtol=1e-5, atol=1e-5)


def test_derivatives_are_the_formulas(rng):
    """jvp in every operand (second order) equals the jvp of the jnp formula."""
    h = jnp.asarray(rng.standard_normal((21, 48)), jnp.float32)
    g, omega = jnp.asarray(rng.standard_normal((21, 24)), jnp.float32), _omega(rng, 21)
    tangents = tuple(jnp.asarray(rng.standard_normal(v.shape), v.dtype) for v in (h, g, omega))
    got = jax.jvp(lambda *a: activate_weighted_grad(*a, "geglu"), (h, g, omega), tangents)[1]
    want = jax.jvp(lambda *a: formula(*a, "geglu"), (h, g, omega), tangents)[1]
    assert len(got) == len(want) == 3
    for x, y in zip(got, want):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-5)


def test_b_takes_the_buffer_of_g(rng):
    """The call aliases g (operand 1) to b (result 2), and where g is computed inside the
    program and read by nothing else, XLA adds no copy of it (a copy fused into g's
    producer, as XLA:CPU makes here, writes g once)."""
    h = jnp.asarray(rng.standard_normal((64, 96)), jnp.float32)
    x, omega = jnp.asarray(rng.standard_normal((64, 48)), jnp.float32), _omega(rng, 64)
    step = jax.jit(lambda h, x, omega: activate_weighted_grad(h, x * 2.0, omega, "swiglu"))
    assert "output_operand_aliases" in step.lower(h, x, omega).as_text()
    entry = step.lower(h, x, omega).compile().as_text().split("ENTRY")[1]
    call = next(line for line in entry.splitlines() if "moe_xla_activate_weighted_grad_cpu_v2" in line)
    assert "output_to_operand_aliasing={{2}: (1, {})}" in call
    assert not re.search(r"= \S+ copy\(", entry), entry
    want = activate_weighted_grad(h, x * 2.0, omega, "swiglu")
    for a, b in zip(step(h, x, omega), want):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_vmap_folds_into_rows(rng):
    h = tricky(rng, (3, 5, 2 * 40), jnp.bfloat16)
    g = jnp.asarray(rng.standard_normal((3, 5, 40)), jnp.bfloat16)
    omega = jnp.asarray(rng.uniform(size=(3, 5)), jnp.float32)
    got = jax.vmap(lambda a, b, c: activate_weighted_grad(a, b, c, "swiglu"), in_axes=(1, 1, 1), out_axes=1)(
        h, g, omega)
    want = activate_weighted_grad(h.reshape(15, 80), g.reshape(15, 40), omega.reshape(15), "swiglu")
    np.testing.assert_array_equal(np.asarray(got[0], np.float32).reshape(15, 80), np.asarray(want[0], np.float32))
    np.testing.assert_array_equal(np.asarray(got[1]).reshape(15), np.asarray(want[1]))
    np.testing.assert_array_equal(np.asarray(got[2], np.float32).reshape(15, 40), np.asarray(want[2], np.float32))
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

    results = [jax.ShapeDtypeStruct((4, 16), jnp.float32), jax.ShapeDtypeStruct((4,), jnp.float32),
               jax.ShapeDtypeStruct((4, 8), jnp.float32)]
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
