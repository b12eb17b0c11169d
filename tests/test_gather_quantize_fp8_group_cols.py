"""gather_quantize_fp8_group_cols: both FP8 tilings of rows gathered from token rows, the
column tiles' rows scaled (common/fp8_blockwise.h, Fp8GroupColsParams with sources).

The kernels (CPU everywhere, CUDA where there is a GPU) bitwise against the reference
evaluated on the CPU, with and without a factor, pow2 scales, f32 / bf16 / f16: tricky data
(zero tiles, subnormals, NaN / inf, ties), ragged groups with empty, clamped and negative
sizes and rows past the groups, K tails and K below 8, no tokens, no rows, no groups;
sources repeated, negative, T and past it; factors of 0, -0, huge, subnormal, inf and NaN,
products at and just below 2^-126 (where XLA's CPU and gradual underflow round apart), and
token rows of +-2^-126 and smaller with factors above 1 (u flushes them, v keeps +-2^-126
scaled). The reference against the contract in numpy; with sources naming each row once,
the composition expand_quantize_fp8_rows + quantize_fp8_group_cols of its rows; vmap
against a loop (invalid sources kept invalid), eager and the reference lowering against the
jitted kernel, sharded operands, the lowering's target, errors in Python and in the handler.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ON_GPU
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from test_expand_quantize_fp8_rows import MIN_NORMAL, _flushed, _tiny_products
from test_fp8_quantize import assert_bitwise, tricky
from test_fp8_wgrad import DTYPES, EDGES, PLATFORMS, _on

import moe_xla
from moe_xla import reference
from moe_xla.primitives.expand_quantize_fp8_rows import expand_quantize_fp8_rows
from moe_xla.primitives.gather_quantize_fp8_group_cols import gather_quantize_fp8_group_cols_p

OP = "gather_quantize_fp8_group_cols"
NAMES = ("q", "row_scales", "q_t", "scales")
# (T, M, K, group sizes): rows past the groups, sizes summing to M exactly (EDGES: around the
# tile edge), clamped and negative sizes, only empty groups, no groups; K with a tail of 128,
# below 8, of 8 whole tiles; M above T (sources repeat) and below; no tokens, no rows.
CASES = [(40, 300, 300, [0, 129, 1, 100]), (64, 685, 136, EDGES), (9, 130, 5, [130]), (20, 257, 260, [300, -5, 7]),
         (30, 256, 1024, [128, 1, 0, 127]), (300, 40, 7, []), (50, 5, 129, [0, 0, 0]), (0, 50, 130, [20, 30]),
         (7, 0, 130, [0, 0])]


def _case_id(case):
    return f"t{case[0]}-m{case[1]}-k{case[2]}-g{len(case[3])}"


def _case(rng, t, m, k, dtype):
    """(values, sources, factor) with the special cases of the module docstring."""
    values = np.array(tricky(rng, (t, k), dtype))
    sources = rng.integers(0, max(t, 1), m).astype(np.int64)
    invalid = np.array([-1, t, t + 1, -(2 ** 31), 2 ** 31 - 1, -7], np.int64)
    sources[3: 3 + invalid.size] = invalid[: max(0, m - 3)]
    factor = (rng.standard_normal(m) * np.exp(rng.uniform(-8, 8, m))).astype(np.float32)
    special = np.array([0.0, -0.0, -1.0, 3e38, -1e30, 1e-40, MIN_NORMAL, np.inf, np.nan], np.float32)
    factor[10: 10 + special.size] = special[: max(0, m - 10)]
    sources[10: 10 + special.size] = np.arange(special.size)[: max(0, m - 10)] % max(t, 1)
    if t > 6 and k >= 4 and m >= 32:
        # Token 6: a tile whose only nonzero entries are +-2^-126 and float32 subnormals. u
        # (factor 1) makes them zeros (a zero tile, scale 1); factors above 1 keep +-2^-126
        # scaled in v (the subnormals stay zeros), twice (a repeated source).
        values[6, :128] = 0.0
        values[6, :4] = [MIN_NORMAL, -MIN_NORMAL, 1e-39, -MIN_NORMAL / 2]
        if k >= 8:  # and the last two columns 0 but for token 6's +-2^-126: column tiles of them
            values[:, -2:] = 0.0
            values[6, -2:] = [MIN_NORMAL, -MIN_NORMAL]
        sources[24:28], factor[24:28] = 6, [4.0, 2.0 ** 20, 1.0, 0.5]
    if t and k >= 4 and m >= 24:
        # Token 0's first elements against the tiny products' factors: one product per row.
        for n, (f, v) in enumerate(_tiny_products(rng, dtype)):
            values[0, n] = v
            sources[20 + n], factor[20 + n] = 0, f
    return jnp.asarray(values), jnp.asarray(sources, jnp.int32), jnp.asarray(factor)


def _op(platform, values, sources, factor, sizes, pow2=False):
    return _on(platform, moe_xla.gather_quantize_fp8_group_cols, values, sources, factor, sizes, pow2_scale=pow2)


def _reference(values, sources, factor, sizes, pow2=False):
    return _on("cpu", reference.gather_quantize_fp8_group_cols, values, sources, factor, sizes, pow2_scale=pow2)


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("with_factor", [True, False], ids=["factor", "no_factor"])
@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_kernel_is_the_reference_bitwise(rng, case, dtype, pow2, with_factor, platform):
    t, m, k, sizes = case
    values, sources, factor = _case(rng, t, m, k, dtype)
    factor = factor if with_factor else None
    gs = jnp.asarray(sizes, jnp.int32)
    out = _op(platform, values, sources, factor, gs, pow2)
    tiles = -(-m // 128) + len(sizes)
    assert [o.shape for o in out] == [(m, k), (m, -(-k // 128)), (k, 128 * tiles), (tiles, k)]
    assert [o.dtype for o in out] == [jnp.float8_e4m3fn, jnp.float32, jnp.float8_e4m3fn, jnp.float32]
    assert_bitwise(out, _reference(values, sources, factor, gs, pow2), "the reference on the CPU", NAMES)


def _numpy_rows(values, sources, factor):
    """u and v of the contract in numpy (no FPU flushing): the float32 product of the operands
    with float32 subnormals as zeros, products of magnitude at most 2^-126 zeros of their
    sign, one rounding to the dtype; zero rows where the source names no token."""
    t, k = values.shape
    named = ((sources >= 0) & (sources < t))[:, None]
    x = np.asarray(values, np.float32)[np.clip(sources, 0, max(t - 1, 0))] if t else np.zeros((len(sources), k))
    tiny = np.nextafter(np.float32(MIN_NORMAL), np.float32(0))
    rows = []
    for f in (np.ones(len(sources), np.float32), factor):
        with np.errstate(invalid="ignore", over="ignore", under="ignore"):
            product = _flushed(_flushed(f[:, None], tiny) * _flushed(x, tiny), np.float32(MIN_NORMAL))
            rows.append(np.where(named, product, np.float32(0)).astype(values.dtype))
    return rows


@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_is_the_contract_in_numpy(rng, dtype):
    """reference.gather_quantize_fp8_group_cols is quantize_fp8_rows of numpy's u and
    quantize_fp8_group_cols of numpy's v; on the CPU, whose flushing would hide a reference
    that left the flush rule to the FPU."""
    t, m, k, sizes = 12, 200, 136, [0, 77, 100]
    values, sources, factor = _case(rng, t, m, k, dtype)
    u, v = _numpy_rows(np.asarray(values), np.asarray(sources), np.asarray(factor))
    gs = jnp.asarray(sizes, jnp.int32)
    want = (*_on("cpu", reference.quantize_fp8_rows, u), *_on("cpu", reference.quantize_fp8_group_cols, v, gs))
    assert_bitwise(_reference(values, sources, factor, gs), want, "the quantisations of numpy's u and v", NAMES)
    u_only = (*want[:2], *_on("cpu", reference.quantize_fp8_group_cols, u, gs))
    assert_bitwise(_reference(values, sources, None, gs), u_only, "numpy's u without factor", NAMES)


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_factors_above_one_keep_the_smallest_normal_in_the_column_tiles(platform, dtype):
    """Token entries +-2^-126 are zeros of their sign in u (a zero row tile: q +-0, scale 1)
    and, times 4, +-2^-124 in v (scale 2^-126, the floor: codes +-4), times 2^100 +-2^-26
    (codes +-448); subnormal entries are zeros in both, whatever the factor; a source naming
    no token gives zeros in both (scales 1)."""
    k = 130
    values = np.zeros((2, k), np.float32)
    values[1, :3] = [MIN_NORMAL, -MIN_NORMAL, 1e-39]
    values = jnp.asarray(values, dtype)
    sources, factor = jnp.asarray([1, 1, 2], jnp.int32), jnp.asarray([4.0, 2.0 ** 100, 4.0], jnp.float32)
    q, row_scales, q_t, scales = _op(platform, values, sources, factor, jnp.asarray([1, 1, 1], jnp.int32))
    assert list(np.asarray(q).view(np.uint8)[0, :3]) == [0x00, 0x80, 0x00] and np.all(np.asarray(row_scales) == 1.0)
    assert np.all(np.asarray(q).view(np.uint8)[:, 3:] == 0)
    codes, scales = np.asarray(q_t).view(np.uint8), np.asarray(scales)
    assert list(scales[0, :3]) == [2.0 ** -126, 2.0 ** -126, 1.0] and list(codes[:3, 0]) == [0x48, 0xC8, 0x00]
    assert scales[1, 0] == np.float32(2.0 ** -26) / np.float32(448) and list(codes[:3, 128]) == [0x7E, 0xFE, 0x00]
    assert np.all(codes[:, 256:] == 0) and np.all(scales[2:] == 1.0)


@pytest.mark.parametrize("platform", PLATFORMS)
def test_nan_and_inf(platform):
    """NaN entries are the NaN code 0x7f in q and q_t; inf saturates to 448 in q and, times a
    factor 0, is NaN in v (0x7f in q_t); a NaN factor makes the row's q_t codes 0x7f and
    leaves q alone."""
    values = jnp.asarray([[np.nan, np.inf, -np.inf, 1.0]], jnp.bfloat16)
    sources = jnp.asarray([0, 0, 0], jnp.int32)
    factor = jnp.asarray([1.0, 0.0, np.nan], jnp.float32)
    q, _, q_t, _ = _op(platform, values, sources, factor, jnp.asarray([1, 1, 1], jnp.int32))
    assert np.all(np.asarray(q).view(np.uint8) == [0x7F, 0x7E, 0xFE, 0x7E])  # 1.0 is the amax: 448
    codes = np.asarray(q_t).view(np.uint8)
    assert list(codes[:, 0]) == [0x7F, 0x7E, 0xFE, 0x7E]
    assert list(codes[:, 128]) == [0x7F, 0x7F, 0x7F, 0x00]  # 0 * (nan, inf, -inf, 1): scale 1
    assert list(codes[:, 256]) == [0x7F] * 4


def _inverse(slots, num_rows):
    """(sources, row factor index) of a slot map naming rows at most once: row slots[p] has
    the token p // k and the pair p; -1 for rows no pair names."""
    flat = np.asarray(slots).reshape(-1)
    pair = np.full(num_rows, -1, np.int64)
    pair[flat] = np.arange(flat.size)
    sources = np.where(pair >= 0, pair // slots.shape[1], -1)
    return jnp.asarray(sources, jnp.int32), pair


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("with_factor", [True, False], ids=["factor", "no_factor"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(37, 8, 300, 260), (64, 2, 128, 136), (12, 3, 36, 7)], ids=str)
def test_each_row_named_once_is_expand_then_group_cols(rng, shape, dtype, with_factor, platform):
    """Slots a permutation (rows past the T k pairs named by none): (q, row_scales) those of
    expand_quantize_fp8_rows, (q_t, scales) quantize_fp8_group_cols of its rows."""
    t, k, r, h = shape
    values = tricky(rng, (t, h), dtype)
    slots = jnp.asarray(rng.permutation(r)[: t * k].reshape(t, k), jnp.int32)
    factor = jnp.asarray((rng.standard_normal((t, k)) * np.exp(rng.uniform(-4, 4, (t, k)))).astype(np.float32))
    factor = factor if with_factor else None
    gs = jnp.asarray(np.diff(np.sort(np.concatenate([[0, r], rng.integers(0, r + 1, 3)]))), jnp.int32)
    sources, pair = _inverse(slots, r)
    row_factor = None if factor is None else jnp.asarray(np.where(pair >= 0, np.asarray(factor).reshape(-1)[pair], 0))

    def composed(values, slots, factor, gs):
        rows, q, scales = expand_quantize_fp8_rows(values, slots, factor, r)
        return (q, scales, *moe_xla.quantize_fp8_group_cols(rows, gs))

    want = _on(platform, composed, values, slots, factor, gs)
    assert_bitwise(_op(platform, values, sources, row_factor, gs), want, "expand + quantize_fp8_group_cols", NAMES)


def _per_element(values, sources, factor, sizes, pow2=False):
    """The op on each batch element, stacked (every argument batched along axis 0)."""
    f = jax.jit(lambda *a: moe_xla.gather_quantize_fp8_group_cols(*a, pow2_scale=pow2))
    outs = [f(values[b], sources[b], None if factor is None else factor[b], sizes[b]) for b in range(sources.shape[0])]
    return [jnp.stack(o) for o in zip(*outs)]


def test_vmap_equals_a_loop_and_keeps_invalid_sources_invalid(rng):
    """Element b's sources name its own token rows: T, -1 and huge ones name none (not the
    next element's first rows), with a factor and without, values batched or shared."""
    b, t, m, k = 3, 9, 300, 136
    cases = [_case(rng, t, m, k, jnp.bfloat16) for _ in range(b)]
    values, sources, factor = (jnp.stack(a) for a in zip(*cases))
    sources = sources.at[:, 40].set(t).at[:, 41].set(-1).at[:, 42].set(2 ** 31 - 1).at[:, 43].set(t - 1)
    sizes = jnp.asarray([[0, 129, 100], [300, 0, 0], [-2, 1, 500]], jnp.int32)
    op = moe_xla.gather_quantize_fp8_group_cols
    out = jax.jit(jax.vmap(lambda *a: op(*a, pow2_scale=True)))(values, sources, factor, sizes)
    assert_bitwise(out, _per_element(values, sources, factor, sizes, True), "the op per element", NAMES)
    out = jax.vmap(lambda v, s, g: op(v, s, None, g))(values, sources, sizes)
    assert_bitwise(out, _per_element(values, sources, None, sizes), "the op per element, no factor", NAMES)
    shared = [jnp.stack([a] * b) for a in (values[0], sizes[1])]
    out = jax.vmap(op, in_axes=(None, 0, 0, None))(values[0], sources, factor, sizes[1])
    assert_bitwise(out, _per_element(shared[0], sources, factor, shared[1]), "the op per element, shared", NAMES)
    moved = jax.vmap(op, in_axes=(1, 0, None, 0), out_axes=(1, 0, 2, 0))(jnp.swapaxes(values, 0, 1), sources,
                                                                        factor[0], sizes)
    want = _per_element(values, sources, jnp.stack([factor[0]] * b), sizes)
    assert_bitwise((jnp.swapaxes(moved[0], 0, 1), moved[1], jnp.moveaxis(moved[2], 2, 0), moved[3]), want,
                   "the op per element, moved axes", NAMES)
    bound = jax.vmap(lambda *a: gather_quantize_fp8_group_cols_p.bind(*a, pow2_scale=False, has_factor=True))(
        values, sources, sizes, factor)
    assert [a.shape for a in bound] == [(b, m, k), (b, m, 2), (b, k, 128 * 6), (b, 6, k)]
    empty = jax.vmap(op)(values, sources[:, :0], factor[:, :0], sizes)
    assert [a.shape for a in empty] == [(b, 0, k), (b, 0, 2), (b, k, 128 * 3), (b, 3, k)]


def test_eager_and_reference_lowering_are_the_kernel(monkeypatch, rng):
    """The eager call and MOE_XLA_IMPL=reference (on the CPU) give the jitted kernel's bits."""
    values, sources, factor = jax.device_put(_case(rng, 12, 140, 300, jnp.bfloat16), jax.devices("cpu")[0])
    gs = jnp.asarray([50, 0, 60], jnp.int32)
    op = moe_xla.gather_quantize_fp8_group_cols
    kernel = jax.jit(op)(values, sources, factor, gs)
    assert_bitwise(op(values, sources, factor, gs), kernel, "the jitted kernel", NAMES)
    monkeypatch.setenv("MOE_XLA_IMPL", "reference")
    f = jax.jit(lambda *a: op(*a))  # a fresh jit: MOE_XLA_IMPL is read while lowering
    assert "moe_xla_gather_quantize_fp8_group_cols" not in f.lower(values, sources, factor, gs).as_text()
    assert_bitwise(f(values, sources, factor, gs), kernel, "the kernel", NAMES)


def test_sharded_operands_give_the_one_device_result(rng):
    """Tokens and rows split over devices: the op runs on the gathered operands."""
    if jax.device_count() < 2:
        pytest.skip("needs 2 devices")
    mesh = Mesh(np.array(jax.devices()[:2]), ("d",))
    values, sources, factor = _case(rng, 24, 300, 256, jnp.float32)
    gs = jnp.asarray([100, 0, 150], jnp.int32)
    f = jax.jit(moe_xla.gather_quantize_fp8_group_cols)
    one = f(*jax.device_get((values, sources, factor, gs)))
    rows = NamedSharding(mesh, P("d"))
    for spec in (P("d"), P(None, "d")):
        split = f(jax.device_put(values, NamedSharding(mesh, spec)), jax.device_put(sources, rows),
                  jax.device_put(factor, rows), gs)
        assert_bitwise(split, one, f"one device ({spec})", NAMES)


@pytest.mark.parametrize("with_factor", [True, False])
def test_lowers_to_one_versioned_call(with_factor):
    platform = "cuda" if ON_GPU else "cpu"
    factor = jnp.zeros((32,), jnp.float32) if with_factor else None
    text = jax.jit(moe_xla.gather_quantize_fp8_group_cols).lower(
        jnp.zeros((8, 256), jnp.bfloat16), jnp.zeros((32,), jnp.int32), factor, jnp.zeros((4,), jnp.int32)).as_text()
    assert text.count(f"moe_xla_gather_quantize_fp8_group_cols_{platform}_v1") == 1
    assert "gather" not in text.replace("gather_quantize", "") and "scatter" not in text


def test_not_differentiable_but_stop_gradient_works():
    sources, factor, gs = jnp.arange(8, dtype=jnp.int32) % 4, jnp.ones((8,)), jnp.asarray([3, 5], jnp.int32)
    loss = lambda v: jnp.sum(moe_xla.gather_quantize_fp8_group_cols(v, sources, factor, gs)[3])  # noqa: E731
    with pytest.raises(TypeError, match=f"{OP} is not differentiable"):
        jax.grad(loss)(jnp.ones((4, 130)))
    grad = jax.grad(lambda v: loss(jax.lax.stop_gradient(v)) + jnp.sum(v))(jnp.ones((4, 130)))
    assert np.all(np.asarray(grad) == 1.0)


V, S, F, G = jnp.zeros((4, 8)), jnp.zeros((6,), jnp.int32), jnp.zeros((6,), jnp.float32), jnp.zeros((2,), jnp.int32)
_OP = moe_xla.gather_quantize_fp8_group_cols


@pytest.mark.parametrize("call, message", [
    (lambda: _OP(V[0], S, F, G), r"expected values of rank 2 \[T, K\], got shape \(8,\)"),
    (lambda: _OP(V.astype(jnp.int32), S, F, G), "expected values of dtype .*, got int32"),
    (lambda: _OP(V.astype(jnp.float8_e4m3fn), S, F, G), "expected values of dtype .*, got float8_e4m3fn"),
    (lambda: _OP(V, S[:, None], F, G), r"expected sources of rank 1 \[M\], got shape \(6, 1\)"),
    (lambda: _OP(V, S.astype(jnp.uint32), F, G), "expected int32 sources, got uint32"),
    (lambda: _OP(V, S, F.astype(jnp.bfloat16), G), "expected float32 factor, got bfloat16"),
    (lambda: _OP(V, S, F[:5], G), r"expected factor of shape \(6,\), got \(5,\)"),
    (lambda: _OP(V, S, F[:, None], G), r"expected factor of shape \(6,\), got \(6, 1\)"),
    (lambda: _OP(V, S, F, G[None]), r"expected group_sizes of rank 1 \[G\], got shape \(1, 2\)"),
    (lambda: _OP(V, S, F, G.astype(jnp.float32)), "expected int32 group_sizes, got float32"),
    (lambda: _OP(V, S, F, G, pow2_scale=1), "expected pow2_scale to be a Python bool"),
    (lambda: jax.eval_shape(lambda s: _OP(V, s, None, G), jax.ShapeDtypeStruct((2 ** 31,), jnp.int32)),
     "expected sources of fewer than 2\\^31 rows, got 2147483648"),
    (lambda: jax.eval_shape(lambda v: _OP(v, S, F, G), jax.ShapeDtypeStruct((2 ** 31, 8), jnp.bfloat16)),
     "expected values of fewer than 2\\^31 rows, got 2147483648"),
    (lambda: gather_quantize_fp8_group_cols_p.bind(V, S, G, pow2_scale=False, has_factor=True),
     r"expected one factor operand \(has_factor=True\), got 0"),
])
def test_bad_inputs_raise_at_trace_time(call, message):
    with pytest.raises((TypeError, ValueError), match=f"{OP}: {message}"):
        jax.eval_shape(call)


F8, F32, BF16, I32 = jnp.float8_e4m3fn, jnp.float32, jnp.bfloat16, jnp.int32
# values [4, 16], 6 rows, 2 groups: q [6, 16], row_scales [6, 1], q_t [16, 384], scales [3, 16].
GOOD_ARGS = (((4, 16), BF16), ((6,), I32), ((2,), I32), ((6,), F32))
GOOD_RESULTS = (((6, 16), F8), ((6, 1), F32), ((16, 384), F8), ((3, 16), F32))


def _replaced(items, index, new):
    return tuple(new if i == index else item for i, item in enumerate(items))


@pytest.mark.parametrize("args, results, message", [
    (_replaced(GOOD_ARGS, 0, ((64,), BF16)), GOOD_RESULTS, r"values: expected rank 2 \[T, K\], got shape \[64\]"),
    (_replaced(GOOD_ARGS, 0, ((4, 16), I32)), GOOD_RESULTS,
     "values: expected dtype float32, bfloat16 or float16, got int32"),
    (_replaced(GOOD_ARGS, 1, ((6, 1), I32)), GOOD_RESULTS, r"sources: expected rank 1 \[M\], got shape \[6, 1\]"),
    (_replaced(GOOD_ARGS, 1, ((6,), F32)), GOOD_RESULTS, "sources: expected dtype int32, got float32"),
    (_replaced(GOOD_ARGS, 2, ((1, 2), I32)), GOOD_RESULTS, r"group_sizes: expected rank 1 \[G\], got shape \[1, 2\]"),
    (_replaced(GOOD_ARGS, 3, ((6,), I32)), GOOD_RESULTS, "factor: expected float32, got int32"),
    (_replaced(GOOD_ARGS, 3, ((5,), F32)), GOOD_RESULTS, r"factor: expected shape \[6\], got \[5\]"),
    (GOOD_ARGS + (((6,), F32),), GOOD_RESULTS,
     r"gather_quantize_fp8_group_cols: expected at most one operand after group_sizes \(factor\), got 2"),
    (GOOD_ARGS, _replaced(GOOD_RESULTS, 0, ((6, 16), jnp.uint8)), "q: expected dtype float8_e4m3fn"),
    (GOOD_ARGS, _replaced(GOOD_RESULTS, 0, ((4, 16), F8)), r"q: expected shape \[6, 16\], got \[4, 16\]"),
    (GOOD_ARGS, _replaced(GOOD_RESULTS, 1, ((6, 2), F32)), r"row_scales: expected shape \[6, 1\], got \[6, 2\]"),
    (GOOD_ARGS, _replaced(GOOD_RESULTS, 2, ((16, 384), jnp.uint8)), "q_t: expected dtype float8_e4m3fn"),
    (GOOD_ARGS, _replaced(GOOD_RESULTS, 2, ((16, 256), F8)), r"q_t: expected shape \[16, 384\], got \[16, 256\]"),
    (GOOD_ARGS, _replaced(GOOD_RESULTS, 3, ((2, 16), F32)), r"scales: expected shape \[3, 16\], got \[2, 16\]"),
])
def test_handler_rejects_inconsistent_buffers(args, results, message):
    """The FFI handler checks what the primitive's shape rule already guarantees, for callers
    that reach the target without it."""
    from moe_xla import _lib

    call = jax.ffi.ffi_call(_lib.require_kernel(OP, "cpu"), [jax.ShapeDtypeStruct(*r) for r in results])
    operands = [jnp.zeros(*a) for a in args]
    with jax.default_device(jax.devices("cpu")[0]), pytest.raises(Exception, match=message):
        jax.block_until_ready(jax.jit(lambda *a: call(*a, pow2_scale=False))(*operands))
