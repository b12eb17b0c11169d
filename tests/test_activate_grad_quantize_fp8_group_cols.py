"""activate_grad_quantize_fp8_group_cols: both FP8 tilings of the routing-weighted expert
activation's backward d h and d omega's tiles, d h never written (common/fp8_blockwise.h,
Fp8GroupColsParams with source kActivationGrad).

On each platform (CPU everywhere, CUDA where there is a GPU) the tilings bitwise that
platform's activate_grad_quantize_fp8 followed by quantize_fp8_group_cols of its d h, and
d_omega_tiles its tiles to float32 rounding (the order of the sums is the kernels'): every
activation, f32 / bf16 / f16, pow2 scales, h with NaN and +-inf, ragged groups with empty,
clamped and negative sizes and rows past the groups, one giant group, M not a multiple of
128, F tails not multiples of 128 nor of 8, no rows, no groups. On h whose activation and
derivative are exact on every platform, the tilings bitwise the reference's. vmap against
a loop, eager and the reference lowering against the jitted kernel, sharded operands, the
lowering's target, errors in Python and in the handler.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ON_GPU
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from test_activate_quantize_fp8 import _h
from test_activate_quantize_fp8_group_cols import _replaced
from test_fp8_quantize import assert_bitwise
from test_fp8_wgrad import DTYPES, EDGES, PLATFORMS, _on

import moe_xla
from moe_xla import reference
from moe_xla.activations import ACTIVATIONS, GATED, activate
from moe_xla.primitives.activate_grad_quantize_fp8 import activate_grad_quantize_fp8_p
from moe_xla.primitives.activate_grad_quantize_fp8_group_cols import activate_grad_quantize_fp8_group_cols

OP = "activate_grad_quantize_fp8_group_cols"
NAMES = ("q", "row_scales", "q_t", "scales")
# (M, F, group sizes, pow2): rows past the groups, sizes summing to M exactly (EDGES: around
# the tile edge, M = 685), one giant group, clamped and negative sizes, whole tiles, only
# empty groups; F with a tail (a multiple of 8 or not), below 8 columns of a tile, whole tiles
# (F = 384: the CUDA kernel's gate and up blocks taken in pairs, out of column order, across
# two CTAs of column blocks).
CASES = [(300, 200, [0, 129, 1, 100], False), (685, 136, EDGES, True), (130, 8, [130], True),
         (257, 130, [300, -5, 7], False), (256, 128, [128, 1, 0, 127], True), (5, 129, [0, 0, 0], False),
         (300, 384, [140, 0, 100, 60], False)]


def _case_id(case):
    return f"m{case[0]}-f{case[1]}-g{len(case[2])}{'-pow2' if case[3] else ''}"


def _inputs(rng, m, f, activation, dtype, make_h=_h):
    """h (with NaN, +-inf, +-80 and zeros: make_h), g [M, F] and omega [M] (a zero and a one
    among them)."""
    omega = rng.uniform(0.0, 1.5, m).astype(np.float32)
    omega[: min(m, 2)] = [0.0, 1.0][: min(m, 2)]
    g = jnp.asarray(rng.standard_normal((m, f)) * 2.0, dtype)
    return make_h(rng, m, f, activation, dtype), g, jnp.asarray(omega)


def _op(platform, h, g, omega, sizes, activation, pow2=False):
    return _on(platform, activate_grad_quantize_fp8_group_cols, h, g, omega, sizes, activation=activation,
               pow2_scale=pow2)


def _activate_grad_then_group_cols(h, g, omega, sizes, activation, pow2_scale=False):
    """The unfused path: activate_grad_quantize_fp8's (q, scales, d_omega_tiles) and
    quantize_fp8_group_cols of its d h."""
    dh, q, scales, d_omega_tiles = activate_grad_quantize_fp8_p.bind(h, g, omega, activation=activation,
                                                                     pow2_scale=pow2_scale)
    return (q, scales, *moe_xla.quantize_fp8_group_cols(dh, sizes, pow2_scale=pow2_scale), d_omega_tiles)


def assert_d_omega_tiles_near(got, want, h, g, activation):
    """d_omega_tiles within float32 rounding of `want`: NaN and inf where it has them, else
    within 2^-16 of the tile's sum of |g a| (sums of up to 128 products in any order)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    assert np.array_equal(np.isnan(got), np.isnan(want)), "NaN where the other is not"
    inf = np.isinf(want)
    assert np.array_equal(got[inf], want[inf]), "a different inf"
    m, f = g.shape
    with jax.default_device(jax.devices("cpu")[0]), np.errstate(invalid="ignore", over="ignore"):
        a = np.asarray(activate(jax.device_get(h), activation), np.float64)
        size = np.abs(np.asarray(g, np.float64) * a)
    size = np.pad(size, ((0, 0), (0, want.shape[1] * 128 - f))).reshape(m, -1, 128).sum(axis=2)
    finite = np.isfinite(want)
    err = np.abs(got[finite] - want[finite])
    assert np.all(err <= 2.0 ** -16 * size[finite] + 1e-30), err.max(initial=0)


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_kernel_is_activate_grad_then_group_cols(rng, case, activation, dtype, platform):
    m, f, sizes, pow2 = case
    (h, g, omega), gs = _inputs(rng, m, f, activation, dtype), jnp.asarray(sizes, jnp.int32)
    out = _op(platform, h, g, omega, gs, activation, pow2)
    c, tiles = h.shape[1], -(-m // 128) + len(sizes)
    assert [o.shape for o in out] == [(m, c), (m, -(-c // 128)), (c, 128 * tiles), (tiles, c), (m, -(-f // 128))]
    assert [o.dtype for o in out] == [jnp.float8_e4m3fn, jnp.float32, jnp.float8_e4m3fn, jnp.float32, jnp.float32]
    want = _on(platform, _activate_grad_then_group_cols, h, g, omega, gs, activation=activation, pow2_scale=pow2)
    assert_bitwise(out[:4], want[:4], "activate_grad_quantize_fp8 + quantize_fp8_group_cols", NAMES)
    assert_d_omega_tiles_near(out[4], want[4], h, g, activation)


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_kernel_against_the_reference(rng, activation, dtype, platform):
    """The tilings bitwise the reference's quantisation of the d h the kernel quantises
    (activate_grad_quantize_fp8's, by the bitwise test above; test_activate_grad_quantize_fp8
    holds it within a few ulps of jax.vjp of the jnp activation)."""
    m, f, sizes = 300, 260, [0, 129, 1, 100]
    (h, g, omega), gs = _inputs(rng, m, f, activation, dtype), jnp.asarray(sizes, jnp.int32)
    out = _op(platform, h, g, omega, gs, activation, True)
    dh = _on(platform, activate_grad_quantize_fp8_p.bind, h, g, omega, activation=activation, pow2_scale=True)[0]
    want = _on("cpu", reference.quantize_fp8_rows_group_cols, jax.device_get(dh), gs, pow2_scale=True)
    assert_bitwise(out[:4], want, "the reference's tilings of the kernel's d h", NAMES)


def _exact_h(rng, m, f, activation, dtype):
    """h whose activation and derivative every platform and the reference compute exactly:
    gates in [40, 100), where gelu is the identity and its derivative 1 in float32 whatever
    the tanh, or, plain, of 0 (gelu'(0) = 1/2, relu' 0); ups of any sign and size. Gated
    gates are never 0: the kernels' d up = da * 0 keeps da's sign, the reference's jax.vjp
    adds a +0 to it (the transpose of splitting gate | up)."""
    gate = rng.uniform(40, 100, (m, f))
    if activation not in GATED:
        return jnp.asarray(np.where(rng.random((m, f)) < 0.2, 0.0, gate), dtype)
    up = rng.standard_normal((m, f)) * np.exp(rng.uniform(-6, 6, (m, 1)))
    return jnp.asarray(np.concatenate([gate, up], axis=1), dtype)


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ["geglu", "gelu", "relu"])
def test_kernel_is_the_reference_where_the_derivative_is_exact(rng, activation, dtype, platform):
    """Where every platform's activation and derivative are exact (_exact_h), d h is
    rnd(omega g up) and rnd(omega g gate) (gated) or rnd(omega g g'(h)) on every platform
    and in the reference, so the tilings are bitwise
    reference.activate_grad_quantize_fp8_group_cols's (the gate and up halves of d h where
    they belong), and d_omega_tiles its sums. omega is never 0 (a d h of -0 in the kernels,
    +0 in the reference's sum of two terms). The reference runs op by op: XLA's fused exp
    and tanh are not exact there. Not silu: the derivative of the reference's
    x exp(x - logaddexp(0, x)) is a few ulps off 1 where the kernels' is 1."""
    m, f, sizes, pow2 = 300, 260, [0, 129, 1, 100], activation == "geglu"
    (h, g, _), gs = _inputs(rng, m, f, activation, dtype, _exact_h), jnp.asarray(sizes, jnp.int32)
    omega = jnp.asarray(rng.uniform(0.25, 1.5, m), jnp.float32)
    out = _op(platform, h, g, omega, gs, activation, pow2)
    with jax.default_device(jax.devices("cpu")[0]), jax.disable_jit():
        want = reference.activate_grad_quantize_fp8_group_cols(*jax.device_get((h, g, omega, gs)), activation,
                                                               pow2_scale=pow2)
    assert_bitwise(out[:4], want[:4], "the reference", NAMES)
    assert_d_omega_tiles_near(out[4], want[4], h, g, activation)


@pytest.mark.parametrize("platform", PLATFORMS)
def test_nan_and_inf(platform):
    """NaN in d h is the NaN code 0x7f in q and q_t; inf saturates to 448 and takes no part
    in the amax; relu'(NaN) is 0; a NaN activation makes its d omega tile NaN."""
    h = jnp.asarray([[1.0, 2.0, -1.0, np.nan, np.inf, 1.0]] * 2, jnp.bfloat16)
    g = jnp.asarray([[np.nan, np.inf, 5.0, 3.0, 4.0, 1.0]] * 2, jnp.bfloat16)
    omega = jnp.asarray([1.0, 0.5], jnp.float32)
    q, row_scales, q_t, scales, d_omega_tiles = _op(platform, h, g, omega, jnp.asarray([1, 1], jnp.int32), "relu")
    # d h = omega * [nan, inf, 0, 0, 4, 1]: in a row tile 4 omega is the amax, 448, and 1
    # omega 112; in the column tiles (one row each) every finite nonzero element is 448.
    codes = [0x7F, 0x7E, 0x00, 0x00, 0x7E, 0x6E]
    assert np.all(np.asarray(q).view(np.uint8) == codes)
    assert list(np.asarray(row_scales)[:, 0]) == [np.float32(4 / 448), np.float32(2 / 448)]
    col_codes = [0x7F, 0x7E, 0x00, 0x00, 0x7E, 0x7E]
    assert [list(np.asarray(q_t).view(np.uint8)[:, col]) for col in (0, 128)] == [col_codes] * 2
    assert list(np.asarray(scales)[:, 5]) == [np.float32(1 / 448), np.float32(0.5 / 448), 1.0]  # tile 2: no row
    assert np.all(np.asarray(scales)[:, :4] == 1.0)  # NaN and inf only, or zeros
    assert np.all(np.isnan(np.asarray(d_omega_tiles)))  # g * a: NaN * 1 and 3 * relu(NaN)
    gated = jnp.asarray([[np.inf, -1.0, 2.0, 1.0]], jnp.float32)  # gate | up, F = 2
    q, *_ = _op(platform, gated, jnp.ones((1, 2), jnp.float32), jnp.ones((1,), jnp.float32),
                jnp.asarray([1], jnp.int32), "swiglu")
    # d gate = up * silu'(inf) = NaN (inf * 0 in it); d up = silu(inf) = inf.
    assert [np.asarray(q).view(np.uint8)[0, i] for i in (0, 2)] == [0x7F, 0x7E]


@pytest.mark.parametrize("platform", PLATFORMS)
def test_no_rows_and_no_groups(rng, platform):
    """No rows: q_t all columns of no row (0), every scale 1; no groups: the rows' own tiles
    past every group, as the unfused path writes them."""
    (h, g, omega), gs = _inputs(rng, 0, 136, "geglu", jnp.bfloat16), jnp.asarray([20, 30], jnp.int32)
    q, row_scales, q_t, scales, d_omega_tiles = _op(platform, h, g, omega, gs, "geglu")
    assert q.shape == (0, 272) and row_scales.shape == (0, 3) and d_omega_tiles.shape == (0, 2)
    assert q_t.shape == (272, 256) and np.all(np.asarray(q_t).view(np.uint8) == 0)
    assert scales.shape == (2, 272) and np.all(np.asarray(scales) == 1.0)
    (h, g, omega), gs = _inputs(rng, 40, 136, "geglu", jnp.bfloat16), jnp.zeros((0,), jnp.int32)
    out = _op(platform, h, g, omega, gs, "geglu")
    want = _on(platform, _activate_grad_then_group_cols, h, g, omega, gs, activation="geglu")
    assert_bitwise(out[:4], want[:4], "activate_grad_quantize_fp8 + quantize_fp8_group_cols", NAMES)
    assert_d_omega_tiles_near(out[4], want[4], h, g, "geglu")


def _per_element(h, g, omega, sizes, activation, pow2=False):
    """The op on each batch element, stacked (every argument batched along axis 0)."""
    f = jax.jit(lambda *a: activate_grad_quantize_fp8_group_cols(*a, activation, pow2_scale=pow2))
    return [jnp.stack(o) for o in zip(*(f(h[b], g[b], omega[b], sizes[b]) for b in range(h.shape[0])))]


def _assert_same(out, want, against):
    assert_bitwise(out[:4], want[:4], against, NAMES)
    np.testing.assert_array_equal(np.asarray(out[4]), np.asarray(want[4]))


def test_vmap_equals_a_loop(rng):
    """The batch folds into M (each element's groups, then a spacer) and the tiles unfold:
    groups summing to less than M, to more (clamped), negative; sizes, g and omega batched
    or shared; batch axes not in front."""
    b, m, f = 3, 300, 136
    h, g, omega = (jnp.stack(v) for v in zip(*(_inputs(rng, m, f, "swiglu", jnp.bfloat16) for _ in range(b))))
    sizes = jnp.asarray([[0, 129, 100], [300, 0, 0], [-2, 1, 500]], jnp.int32)
    op = activate_grad_quantize_fp8_group_cols
    out = jax.jit(jax.vmap(lambda *a: op(*a, "swiglu", pow2_scale=True)))(h, g, omega, sizes)
    _assert_same(out, _per_element(h, g, omega, sizes, "swiglu", True), "the op per element")
    out = jax.vmap(op, in_axes=(0, None, None, None, None))(h, g[1], omega[1], sizes[2], "swiglu")
    shared = (jnp.stack([v] * b) for v in (g[1], omega[1], sizes[2]))
    _assert_same(out, _per_element(h, *shared, "swiglu"), "the op per element, shared")
    moved = jax.vmap(lambda *a: op(*a, "swiglu"), in_axes=(1, 1, 0, 0), out_axes=(1, 0, 2, 0, 1))(
        jnp.swapaxes(h, 0, 1), jnp.swapaxes(g, 0, 1), omega, sizes)
    _assert_same((jnp.swapaxes(moved[0], 0, 1), moved[1], jnp.moveaxis(moved[2], 2, 0), moved[3],
                  jnp.swapaxes(moved[4], 0, 1)), _per_element(h, g, omega, sizes, "swiglu"),
                 "the op per element, moved axes")
    empty = jax.vmap(lambda *a: op(*a, "relu"))(h[:, :0], jnp.zeros((b, 0, 2 * f), h.dtype), omega[:, :0],
                                                 sizes)  # no rows: F = 2 f = 272
    assert [a.shape for a in empty] == [(b, 0, 2 * f), (b, 0, 3), (b, 2 * f, 128 * 3), (b, 3, 2 * f), (b, 0, 3)]


def test_eager_and_reference_lowering(monkeypatch, rng):
    """The eager call gives the jitted kernel's bits; MOE_XLA_IMPL=reference (on the CPU)
    lowers to no kernel call and, for relu (exact), gives the same tilings too (on a finite
    h: XLA's fused maximum may take relu(NaN) to 0 in the reference's d omega)."""
    cpu = jax.devices("cpu")[0]
    h, g, omega = jax.device_put(_inputs(rng, 140, 300, "relu", jnp.bfloat16), cpu)
    h = jnp.where(jnp.isfinite(h), h, 1.0)
    gs = jax.device_put(jnp.asarray([50, 0, 60], jnp.int32), cpu)
    op = activate_grad_quantize_fp8_group_cols
    kernel = jax.jit(op, static_argnums=4)(h, g, omega, gs, "relu")
    _assert_same(op(h, g, omega, gs, "relu"), kernel, "the jitted kernel")
    monkeypatch.setenv("MOE_XLA_IMPL", "reference")
    f = jax.jit(lambda *a: op(*a, "relu"))  # a fresh jit: MOE_XLA_IMPL is read while lowering
    assert f"moe_xla_{OP}" not in f.lower(h, g, omega, gs).as_text()
    out = f(h, g, omega, gs)
    assert_bitwise(out[:4], kernel[:4], "the kernel", NAMES)
    assert_d_omega_tiles_near(out[4], kernel[4], h, g, "relu")


def test_sharded_operands_give_the_one_device_result(rng):
    """h, g and omega split along rows, or h and g along columns: the op runs on the gathered
    operands."""
    if jax.device_count() < 2:
        pytest.skip("needs 2 devices")
    mesh = Mesh(np.array(jax.devices()[:2]), ("d",))
    h, g, omega = _inputs(rng, 300, 256, "geglu", jnp.float32)
    gs = jnp.asarray([100, 0, 150], jnp.int32)
    f = jax.jit(lambda *a: activate_grad_quantize_fp8_group_cols(*a, "geglu"))
    one = f(*jax.device_get((h, g, omega, gs)))
    for spec, omega_spec in ((P("d"), P("d")), (P(None, "d"), P())):
        args = [jax.device_put(v, NamedSharding(mesh, s)) for v, s in ((h, spec), (g, spec), (omega, omega_spec))]
        _assert_same(f(*args, gs), one, f"one device ({spec})")


def test_lowers_to_one_versioned_call():
    platform = "cuda" if ON_GPU else "cpu"
    text = jax.jit(lambda *a: activate_grad_quantize_fp8_group_cols(*a, "swiglu")).lower(
        jnp.zeros((32, 512), jnp.bfloat16), jnp.zeros((32, 256), jnp.bfloat16), jnp.ones((32,), jnp.float32),
        jnp.zeros((4,), jnp.int32)).as_text()
    assert text.count(f"moe_xla_{OP}_{platform}_v1") == 1
    assert text.count("custom_call") == 1  # no activate_grad_quantize_fp8, no quantize_fp8_group_cols of its own


def test_not_differentiable_but_stop_gradient_works():
    gs, omega = jnp.asarray([3, 5], jnp.int32), jnp.ones((8,), jnp.float32)
    loss = lambda h: jnp.sum(activate_grad_quantize_fp8_group_cols(h, h, omega, gs, "silu")[4])  # noqa: E731
    with pytest.raises(TypeError, match=f"{OP} is not differentiable"):
        jax.grad(loss)(jnp.ones((8, 130)))
    grad = jax.grad(lambda h: loss(jax.lax.stop_gradient(h)) + jnp.sum(h))(jnp.ones((8, 130)))
    assert np.all(np.asarray(grad) == 1.0)


H, G, W, S = jnp.zeros((6, 16)), jnp.zeros((6, 8)), jnp.ones((6,)), jnp.zeros((2,), jnp.int32)
_OP = activate_grad_quantize_fp8_group_cols


@pytest.mark.parametrize("call, message", [
    (lambda: _OP(H, G, W, S, "tanh"), r"expected activation in \('swiglu', .*\), got 'tanh'"),
    (lambda: _OP(H[:, :7], G, W, S, "swiglu"), "gated activation 'swiglu' needs h \\[M, 2F\\] \\(gate \\| up\\), "
                                               "got an odd last dim 7"),
    (lambda: _OP(H[0], G, W, S, "relu"), r"expected h of rank 2 \[M, 2F\] or \[M, F\], got shape \(16,\)"),
    (lambda: _OP(H, G[None], W, S, "relu"), r"expected g of rank 2 \[M, F\], got shape \(1, 6, 8\)"),
    (lambda: _OP(H, G, W[None], S, "relu"), r"expected omega of rank 1 \[M\], got shape \(1, 6\)"),
    (lambda: _OP(H.astype(jnp.int32), G, W, S, "relu"), "expected h of dtype .*, got int32"),
    (lambda: _OP(H, G.astype(jnp.bfloat16), W, S, "swiglu"), r"expected g of the dtype of h \(float32\), "
                                                             "got bfloat16"),
    (lambda: _OP(H, G, W.astype(jnp.bfloat16), S, "swiglu"), "expected float32 omega, got bfloat16"),
    (lambda: _OP(H, G, W, S, "relu"), r"expected g of shape \(6, 16\) \(\[M, F\] for h \(6, 16\)\), got \(6, 8\)"),
    (lambda: _OP(H, G[:5], W, S, "swiglu"), r"expected g of shape \(6, 8\) \(\[M, F\] for h \(6, 16\)\), "
                                            r"got \(5, 8\)"),
    (lambda: _OP(H, G, W[:5], S, "swiglu"), r"expected omega of shape \(6,\) \(M of h\), got \(5,\)"),
    (lambda: _OP(H, G, W, S[None], "swiglu"), r"expected group_sizes of rank 1 \[G\], got shape \(1, 2\)"),
    (lambda: _OP(H, G, W, S.astype(jnp.float32), "swiglu"), "expected int32 group_sizes, got float32"),
    (lambda: _OP(H, G, W, S, "swiglu", pow2_scale=1), "expected pow2_scale to be a Python bool"),
])
def test_bad_inputs_raise_at_trace_time(call, message):
    with pytest.raises((TypeError, ValueError), match=f"{OP}: {message}"):
        jax.eval_shape(call)


F8, F32, BF16, I32 = jnp.float8_e4m3fn, jnp.float32, jnp.bfloat16, jnp.int32
# h [6, 16] (swiglu: F = 8, d h [6, 16]), g [6, 8], omega [6], 2 groups: q [6, 16],
# row_scales [6, 1], q_t [16, 384], scales [3, 16], d_omega_tiles [6, 1].
GOOD_ARGS = (((6, 16), BF16), ((6, 8), BF16), ((6,), F32), ((2,), I32))
GOOD_RESULTS = (((6, 16), F8), ((6, 1), F32), ((16, 384), F8), ((3, 16), F32), ((6, 1), F32))


# h's rank and dtype: decode_activation_input, which test_activate_quantize_fp8_group_cols
# covers through its handler; here that this handler runs it.
@pytest.mark.parametrize("args, results, activation, message", [
    (GOOD_ARGS, GOOD_RESULTS, 5, r"activation: expected 0 \.\. 4, got 5"),
    (_replaced(GOOD_ARGS, 0, ((6, 15), BF16)), GOOD_RESULTS, 0, r"h: expected an even last dim \(gate \| up\), "
                                                                r"got \[6, 15\]"),
    (GOOD_ARGS, GOOD_RESULTS, 2, r"g: expected shape \[6, 16\], got \[6, 8\]"),  # gelu: F = 16
    (_replaced(GOOD_ARGS, 1, ((6, 8), F32)), GOOD_RESULTS, 0, "g: expected the dtype of h bfloat16, got float32"),
    (_replaced(GOOD_ARGS, 1, ((5, 8), BF16)), GOOD_RESULTS, 0, r"g: expected shape \[6, 8\], got \[5, 8\]"),
    (_replaced(GOOD_ARGS, 2, ((5,), F32)), GOOD_RESULTS, 0, r"omega: expected shape \[6\], got \[5\]"),
    (_replaced(GOOD_ARGS, 3, ((1, 2), I32)), GOOD_RESULTS, 0, r"group_sizes: expected rank 1 \[G\], got shape "
                                                              r"\[1, 2\]"),
    (GOOD_ARGS, _replaced(GOOD_RESULTS, 0, ((6, 16), jnp.uint8)), 0, "q: expected dtype float8_e4m3fn"),
    (GOOD_ARGS, _replaced(GOOD_RESULTS, 0, ((6, 8), F8)), 0, r"q: expected shape \[6, 16\], got \[6, 8\]"),
    (GOOD_ARGS, _replaced(GOOD_RESULTS, 1, ((6, 2), F32)), 0, r"row_scales: expected shape \[6, 1\], got \[6, 2\]"),
    (GOOD_ARGS, _replaced(GOOD_RESULTS, 2, ((8, 384), F8)), 0, r"q_t: expected shape \[16, 384\], got \[8, 384\]"),
    (GOOD_ARGS, _replaced(GOOD_RESULTS, 3, ((2, 16), F32)), 0, r"scales: expected shape \[3, 16\], got \[2, 16\]"),
    (GOOD_ARGS, _replaced(GOOD_RESULTS, 4, ((6, 2), F32)), 0, r"d_omega_tiles: expected shape \[6, 1\], got \[6, 2\]"),
])
def test_handler_rejects_inconsistent_buffers(args, results, activation, message):
    """The FFI handler checks what the primitive's shape rule already guarantees, for callers
    that reach the target without it."""
    with pytest.raises(Exception, match=message):
        _call_the_handler(args, results, activation)


def _call_the_handler(args, results, activation):
    """The CPU handler on zeros of the shapes and dtypes `args`, into `results`."""
    from moe_xla import _lib

    call = jax.ffi.ffi_call(_lib.require_kernel(OP, "cpu"), [jax.ShapeDtypeStruct(*r) for r in results])
    with jax.default_device(jax.devices("cpu")[0]):
        return jax.block_until_ready(jax.jit(lambda *a: call(*a, activation=np.int32(activation), pow2_scale=False))(
            *[jnp.zeros(*a) for a in args]))


def test_the_handler_accepts_the_good_buffers():
    """GOOD_ARGS and GOOD_RESULTS are a consistent call (the errors above come from the
    replaced buffer alone): the kernel's result on zeros, codes 0, scales 1, d omega 0."""
    out = _call_the_handler(GOOD_ARGS, GOOD_RESULTS, 0)
    assert all(np.all(np.asarray(o).view(np.uint8) == 0) for o in out[0:4:2])
    assert all(np.all(np.asarray(s) == 1.0) for s in out[1:4:2])
    assert np.all(np.asarray(out[4]) == 0.0)
