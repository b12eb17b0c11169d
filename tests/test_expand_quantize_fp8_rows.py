"""expand_quantize_fp8_rows: token rows expanded into the rows of their pairs, each scaled,
fused with the FP8 row quantisation.

The kernels (CPU everywhere, CUDA where there is a GPU) against the reference evaluated on
the CPU: rows bitwise (NaN where the reference is NaN: a NaN's sign and payload are the
platform's), q and scales bitwise, and those the quantisation of the unscaled rows (factor
1), not of the scaled rows returned. Data: every special case of the quantisation (tricky),
widths with tails and odd, no tokens, k of 1 and 0, no rows; slots a permutation of the
rows, or with rows named twice and three times, rows named by none and entries outside
[0, R) (negative, R, huge); factors of 0, -0, negative, huge, subnormal, inf and NaN, and
products at and just below 2^-126, where XLA's CPU (denormals flushed) and gradual
underflow round apart; token rows holding +-2^-126, which the unscaled rows make zeros.
The reference against numpy (the owner of a row written out as a
loop); vmap (the batch folded into T and R, invalid slots kept invalid), jit, eager, the
reference lowering, sharded operands, errors.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ON_GPU, requires_gpu
from test_fp8_quantize import _reference_on, assert_bitwise, tricky

import moe_xla._rows as _rows
from moe_xla import reference
from moe_xla.primitives.expand_quantize_fp8_rows import expand_quantize_fp8_rows, expand_quantize_fp8_rows_p

PLATFORMS = ["cpu", pytest.param("gpu", marks=requires_gpu)]
DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
# (T, k, R, H): H a multiple of 8 takes the CUDA kernel's vector accesses; tails of 128, an
# odd H; R = T * k (every row named once when permuted), fewer rows (rows named twice),
# more rows (rows no pair names); no tokens, k = 0, no rows, no columns.
SHAPES = [(37, 8, 296, 256), (40, 2, 90, 300), (64, 1, 64, 136), (3, 3, 9, 7), (9, 4, 20, 128), (0, 4, 6, 130),
          (5, 0, 3, 128), (10, 2, 0, 128), (6, 2, 12, 0)]
MIN_NORMAL = 2.0 ** -126


def _tiny_products(rng, dtype):
    """(factor, value) pairs, value of dtype, whose products lie at 2^-126: two whose exact
    product is in 2^-126 [1 - 2^-24, 1 - 2^-25), which gradual underflow rounds up to 2^-126
    and XLA's CPU flushes to 0; one of exactly 2^-126; one a float32 ulp above (kept)."""
    value = np.unique(rng.uniform(1, 2, 2048).astype(jnp.dtype(dtype))).astype(np.float64) * 2.0 ** -6
    near = (MIN_NORMAL / value).astype(np.float32).view(np.uint32)
    factor = (near[:, None].astype(np.int64) + np.arange(-2, 3)).astype(np.uint32).view(np.float32)
    exact = factor.astype(np.float64) * value[:, None]
    i, j = np.nonzero((exact >= MIN_NORMAL * (1 - 2.0 ** -24)) & (exact < MIN_NORMAL * (1 - 2.0 ** -25)))
    assert i.size >= 2, "no product between the two roundings"
    pairs = [(factor[i[n], j[n]], value[i[n]]) for n in range(2)]
    return pairs + [(np.float32(2.0 ** -120), 2.0 ** -6), (np.nextafter(np.float32(2.0 ** -120), np.inf), 2.0 ** -6)]


def _case(rng, t, k, r, h, dtype, *, permutation=False):
    """(values, slots, factor) with the special cases of the module docstring; with
    permutation, slots name each of the R = T * k rows once (permute's row map)."""
    values = np.array(tricky(rng, (t, h), dtype))
    n = t * k
    if permutation:
        slots = rng.permutation(n).astype(np.int64)
    else:
        slots = rng.integers(0, max(r, 1), n).astype(np.int64)
        invalid = np.array([-1, r, r + 1, -(2 ** 31), 2 ** 31 - 1, -7], np.int64)
        slots[5: 5 + invalid.size] = invalid[: max(0, n - 5)]
        if n > 14:
            slots[11:14] = slots[0]  # a row named three times, by pairs of other tokens
    factor = (rng.standard_normal(n) * np.exp(rng.uniform(-8, 8, n))).astype(np.float32)
    special = np.array([0.0, -0.0, -1.0, 3e38, -1e30, 1e-40, MIN_NORMAL, np.inf, np.nan], np.float32)
    factor[14: 14 + special.size] = special[: max(0, n - 14)]
    if t and k and h >= 4:
        # Token 0's first elements against the tiny products' factors, on pairs of token 0
        # only (the pairs 0 .. k - 1), one product per pair.
        for m, (f, v) in enumerate(_tiny_products(rng, dtype)[:k]):
            values[0, m] = v
            factor[m] = f
    if t > 5 and h >= 2:
        # A tile whose only nonzero entries are +-2^-126: its unscaled row is a zero tile
        # (scale 1), where quantising the token row itself would give the scale 2^-126.
        values[5, :128] = 0.0
        values[5, :2] = [MIN_NORMAL, -MIN_NORMAL]
    return (jnp.asarray(values), jnp.asarray(slots.reshape(t, k), jnp.int32),
            jnp.asarray(factor.reshape(t, k)))


def _bits(a):
    a = np.asarray(a)
    return a.view(f"uint{8 * a.dtype.itemsize}")


def assert_rows_bitwise(rows, want, against="the reference"):
    """rows bitwise want, but for NaN, which only has to be NaN where want is."""
    assert rows.shape == want.shape and rows.dtype == want.dtype, (rows.shape, rows.dtype, want.shape, want.dtype)
    nan = np.isnan(np.asarray(want, np.float32))
    np.testing.assert_array_equal(np.isnan(np.asarray(rows, np.float32)), nan, "rows: NaN elsewhere than " + against)
    got, ref = _bits(rows), _bits(want)
    bad = np.argwhere((got != ref) & ~nan)
    if bad.size:
        first = tuple(bad[0])
        raise AssertionError(f"rows: {len(bad)} of {got.size} differ from {against}, first at {first}: "
                             f"{got[first]:#x} vs {ref[first]:#x}")


def assert_outputs_bitwise(out, want, against="the reference"):
    assert_rows_bitwise(out[0], want[0], against)
    assert_bitwise(out[1:], want[1:], against)


def _on(platform, *args):
    return [jax.device_put(a, jax.devices(platform)[0]) for a in args]


def _reference_on_cpu(values, slots, factor, num_rows, pow2=False):
    return _reference_on("cpu", lambda a: reference.expand_quantize_fp8_rows(*a, num_rows, pow2_scale=pow2),
                         (values, slots, factor))


def _owners(slots, num_rows):
    """The contract's owner of each row, as a loop: the last pair in row-major order naming it."""
    owner = np.full(num_rows, -1, np.int64)
    for p, r in enumerate(np.asarray(slots).reshape(-1)):
        if 0 <= r < num_rows:
            owner[r] = p
    return owner


def _flushed(v, limit):
    """v with entries of magnitude at most limit replaced by zeros of their sign."""
    return np.where(np.abs(v) <= limit, np.copysign(np.float32(0), v), v).astype(np.float32)


def _unscaled_rows(values, slots, num_rows):
    """The rows q and scales quantise, in numpy: each named row its owner's token row with
    factor 1 (entries of magnitude at most 2^-126 as zeros of their sign; rounding back to
    the dtype is exact), zero rows where no pair names the row."""
    t, h = values.shape
    owner = _owners(slots, num_rows)
    named = owner >= 0
    x = np.zeros((num_rows, h), np.float32)
    if t:
        x = np.asarray(values, np.float32)[np.maximum(owner, 0) // max(slots.shape[1], 1)]
    with np.errstate(invalid="ignore"):
        x = _flushed(x, np.float32(MIN_NORMAL))
    return np.where(named[:, None], x, np.float32(0)).astype(values.dtype)


def _quantized(rows, pow2=False):
    return _reference_on("cpu", reference.quantize_fp8_rows, rows, pow2_scale=pow2)


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("permutation", [False, True], ids=["any_slots", "permutation"])
def test_kernel_is_the_reference_bitwise(rng, permutation, shape, dtype, pow2, platform):
    t, k, r, h = shape
    if permutation:
        r = t * k
    values, slots, factor = _case(rng, t, k, r, h, dtype, permutation=permutation)
    f = jax.jit(lambda *a: expand_quantize_fp8_rows(*a, r, pow2_scale=pow2))
    out = f(*_on(platform, values, slots, factor))
    assert out[0].shape == (r, h) and out[0].dtype == values.dtype and out[1].shape == (r, h)
    assert out[2].shape == (r, -(-h // 128))
    want = _reference_on_cpu(values, slots, factor, r, pow2)
    assert_outputs_bitwise(out, want, "the reference on the CPU")
    # The contract's own claims: rows no pair names are zero rows, q and scales those of
    # the unscaled rows (numpy's).
    named = _owners(slots, r) >= 0
    assert np.all(_bits(out[0])[~named] == 0) and np.all(_bits(out[1])[~named] == 0)
    assert np.all(np.asarray(out[2])[~named] == 1.0)
    assert_bitwise(out[1:], _quantized(_unscaled_rows(values, slots, r), pow2),
                   "quantize_fp8_rows of the unscaled rows")


@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_is_the_contract_in_numpy(rng, dtype):
    """reference.expand_quantize_fp8_rows against the rule written out in numpy: each row's
    owner by a loop (the last pair naming it), the float32 product underflowing gradually
    with operands' float32 subnormals as zeros and products of magnitude at most 2^-126 as
    zeros of their sign, one rounding to the dtype; q and scales of the same rows with
    factor 1; on the CPU, whose flushing would hide a reference that left it to the FPU."""
    t, k, r, h = 7, 6, 40, 130
    values, slots, factor = _case(rng, t, k, r, h, dtype)
    owner = _owners(slots, r)
    named = owner >= 0
    pair = np.maximum(owner, 0)
    x = np.asarray(values, np.float32)[pair // k]
    s = np.asarray(factor).reshape(-1)[pair][:, None]

    with np.errstate(invalid="ignore", over="ignore", under="ignore"):
        tiny = np.nextafter(np.float32(MIN_NORMAL), np.float32(0))
        product = _flushed(_flushed(s, tiny) * _flushed(x, tiny), np.float32(MIN_NORMAL))
        rows = np.where(named[:, None], product, np.float32(0)).astype(jnp.dtype(dtype))
    got = _reference_on_cpu(values, slots, factor, r)
    assert_rows_bitwise(got[0], rows, "numpy")
    assert_bitwise(got[1:], _quantized(_unscaled_rows(values, slots, r)), "quantize_fp8_rows of numpy's unscaled rows")


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_q_is_the_unscaled_rows_whatever_the_factors(rng, dtype, pow2, platform):
    """Factors 0.37 and 3.0: the rows are scaled, q and scales bitwise those of the rows with
    factor 1 (the op's own with factors 1, and numpy's), which differ from the scaled rows'."""
    t, k, h = 16, 2, 300
    values = tricky(rng, (t, h), dtype)
    slots = jnp.asarray(rng.permutation(t * k).reshape(t, k), jnp.int32)
    factor = jnp.asarray(np.tile(np.float32([0.37, 3.0]), (t, 1)))
    f = jax.jit(lambda *a: expand_quantize_fp8_rows(*a, t * k, pow2_scale=pow2))
    out = f(*_on(platform, values, slots, factor))
    ones = f(*_on(platform, values, slots, jnp.ones_like(factor)))
    unscaled = _unscaled_rows(values, slots, t * k)
    assert_rows_bitwise(ones[0], unscaled, "numpy's unscaled rows")
    assert_bitwise(out[1:], _quantized(unscaled, pow2), "quantize_fp8_rows of the unscaled rows")
    assert_bitwise(out[1:], ones[1:], "the op with factors 1")
    assert_rows_bitwise(out[0], _reference_on_cpu(values, slots, factor, t * k)[0], "the reference")
    scaled = _quantized(jax.device_get(out[0]), pow2)
    assert np.any(_bits(out[1]) != _bits(scaled[0])) and np.any(np.asarray(out[2]) != np.asarray(scaled[1]))


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_are_the_unfused_expansion_away_from_the_smallest_normal(rng, dtype, platform):
    """With permute's row map as slots and no product near 2^-126, the rows are the plain
    jnp of the weighted expansion (_rows.expand_rows: the float32 product, one rounding)."""
    t, k, h = 11, 4, 200
    values, slots, factor = _case(rng, t, k, t * k, h, dtype, permutation=True)
    factor = factor.at[0].set(1.0)  # no tiny products

    def unfused(v, s, f):
        return _rows.expand_rows(v, s, f, num_pairs=t * k)

    want = _reference_on("cpu", lambda a: unfused(*a), (values, slots, factor))
    out = jax.jit(lambda *a: expand_quantize_fp8_rows(*a, t * k))(*_on(platform, values, slots, factor))
    assert_rows_bitwise(out[0], want, "the unfused jnp")


@pytest.mark.parametrize("platform", PLATFORMS)
def test_slots_naming_no_row_read_nothing_and_give_zero_rows(rng, platform):
    """Every slot outside [0, R), any factor: rows +0, q 0, scales 1; no tokens at all too."""
    slots = jnp.asarray([[-1, 3], [4, -(2 ** 31)], [2 ** 31 - 1, 1000]], jnp.int32)
    factor = jnp.asarray([[1.0, np.nan], [np.inf, -2.0], [0.0, 1e30]], jnp.float32)
    cases = [(tricky(rng, (3, 260), jnp.bfloat16), slots, factor),
             (jnp.zeros((0, 260), jnp.bfloat16), slots[:0], factor[:0])]
    for values, s, f in cases:
        rows, q, scales = jax.jit(lambda *a: expand_quantize_fp8_rows(*a, 3))(*_on(platform, values, s, f))
        assert np.all(_bits(rows) == 0) and np.all(_bits(q) == 0)
        np.testing.assert_array_equal(np.asarray(scales), np.ones((3, 3), np.float32))


@pytest.mark.parametrize("platform", PLATFORMS)
def test_a_row_named_twice_is_its_last_pair(platform):
    """Rows named by several pairs take the last pair's term (its token for q and scales),
    the same on every call."""
    values = jnp.asarray(np.arange(1, 4, dtype=np.float32)[:, None] * np.ones((3, 136), np.float32))
    slots = jnp.asarray([[1, 0], [1, 2], [0, 1]], jnp.int32)  # row 1: pairs 0, 2, 5; row 0: pairs 1, 4
    factor = jnp.asarray([[10.0, 20.0], [30.0, 40.0], [50.0, 60.0]], jnp.float32)
    f = jax.jit(lambda *a: expand_quantize_fp8_rows(*a, 3))
    for _ in range(3):
        rows, _, scales = f(*_on(platform, values, slots, factor))
        np.testing.assert_array_equal(np.asarray(rows)[:, 0], [50.0 * 3, 60.0 * 3, 40.0 * 2])
        np.testing.assert_array_equal(np.asarray(scales)[:, 0], np.float32([3, 3, 2]) / np.float32(448))


def _per_batch(values, slots, factor, num_rows, pow2=False):
    """The op on each batch entry, stacked (every argument batched along axis 0)."""
    f = jax.jit(lambda *a: expand_quantize_fp8_rows(*a, num_rows, pow2_scale=pow2))
    outs = [f(values[b], slots[b], factor[b]) for b in range(slots.shape[0])]
    return [jnp.stack(o) for o in zip(*outs)]


def _batch_of_cases(rng, b, t, k, r, h, dtype):
    cases = [_case(rng, t, k, r, h, dtype) for _ in range(b)]
    return [jnp.stack(a) for a in zip(*cases)]


def test_vmap_folds_the_batch_and_keeps_invalid_slots_invalid(rng):
    """Batch entry b's slots name its own rows; R itself, negative and huge entries name no
    row instead of the next entry's."""
    t, k, r = 9, 3, 30
    values, slots, factor = _batch_of_cases(rng, 3, t, k, r, 140, jnp.bfloat16)
    slots = slots.at[:, 4, 0].set(r).at[:, 4, 1].set(-1).at[:, 4, 2].set(2 ** 31 - 1).at[:, 5, 0].set(2 * r - 1)
    want = _per_batch(values, slots, factor, r, True)
    f = jax.vmap(lambda *a: expand_quantize_fp8_rows(*a, r, pow2_scale=True))
    assert_outputs_bitwise(f(values, slots, factor), want, "the op per batch entry")
    moved = jax.vmap(lambda *a: expand_quantize_fp8_rows(*a, r), in_axes=(1, 2, 0), out_axes=(1, 0, 2))(
        jnp.swapaxes(values, 0, 1), jnp.moveaxis(slots, 0, 2), factor)
    want = _per_batch(values, slots, factor, r)
    assert_outputs_bitwise((jnp.swapaxes(moved[0], 0, 1), moved[1], jnp.moveaxis(moved[2], 2, 0)), want,
                           "the op per batch entry")
    bind = lambda *a: expand_quantize_fp8_rows_p.bind(*a, num_rows=r, pow2_scale=False, has_factor=True)  # noqa: E731
    bound = jax.vmap(bind)(values, slots, factor)
    assert [a.shape for a in bound] == [(3, r, 140), (3, r, 140), (3, r, 2)]


def test_vmap_with_unbatched_operands(rng):
    t, k, r = 6, 2, 14
    values, slots, factor = _batch_of_cases(rng, 4, t, k, r, 130, jnp.float32)
    b = slots.shape[0]
    g = lambda *a: expand_quantize_fp8_rows(*a, r)  # noqa: E731
    out = jax.vmap(g, in_axes=(None, 0, 0))(values[0], slots, factor)
    assert_outputs_bitwise(out, _per_batch(jnp.stack([values[0]] * b), slots, factor, r), "the op per batch entry")
    out = jax.vmap(g, in_axes=(0, None, None))(values, slots[1], factor[1])
    assert_outputs_bitwise(out, _per_batch(values, jnp.stack([slots[1]] * b), jnp.stack([factor[1]] * b), r),
                           "the op per batch entry")
    out = jax.vmap(g, in_axes=(None, None, 0))(values[0], slots[0], factor)
    assert_outputs_bitwise(out, _per_batch(jnp.stack([values[0]] * b), jnp.stack([slots[0]] * b), factor, r),
                           "the op per batch entry")


def test_eager_and_reference_lowering_are_the_kernel(monkeypatch, rng):
    """The eager call and MOE_XLA_IMPL=reference (on the CPU: XLA:GPU's division may round
    the reference's scales apart, test_fp8_quantize says) give the jitted kernel's bits."""
    args = _on("cpu", *_case(rng, 12, 3, 33, 300, jnp.bfloat16))
    g = lambda *a: expand_quantize_fp8_rows(*a, 33)  # noqa: E731
    kernel = jax.jit(g)(*args)
    assert_outputs_bitwise(g(*args), kernel, "the jitted kernel")
    monkeypatch.setenv("MOE_XLA_IMPL", "reference")
    f = jax.jit(lambda *a: g(*a))  # a fresh jit: MOE_XLA_IMPL is read while lowering
    assert "moe_xla_expand_quantize_fp8_rows" not in f.lower(*args).as_text()
    assert_outputs_bitwise(f(*args), kernel, "the kernel")


def test_lowers_to_one_versioned_call():
    platform = "cuda" if ON_GPU else "cpu"
    text = jax.jit(lambda *a: expand_quantize_fp8_rows(*a, 32)).lower(
        jnp.zeros((8, 256), jnp.bfloat16), jnp.zeros((8, 4), jnp.int32), jnp.zeros((8, 4), jnp.float32)).as_text()
    assert text.count(f"moe_xla_expand_quantize_fp8_rows_{platform}_v2") == 1
    assert "moe_xla_quantize_fp8_rows" not in text and "scatter" not in text and "gather" not in text


def test_not_differentiable_but_stop_gradient_works():
    values, slots, factor = jnp.ones((4, 130)), jnp.arange(8, dtype=jnp.int32).reshape(4, 2), jnp.ones((4, 2))
    loss = lambda v: jnp.sum(expand_quantize_fp8_rows(v, slots, factor, 8)[0])  # noqa: E731
    with pytest.raises(TypeError, match="expand_quantize_fp8_rows is not differentiable"):
        jax.grad(loss)(values)
    grad = jax.grad(lambda v: loss(jax.lax.stop_gradient(v)) + jnp.sum(v))(values)
    assert np.all(np.asarray(grad) == 1.0)


V, I, S = jnp.zeros((4, 8)), jnp.zeros((4, 2), jnp.int32), jnp.zeros((4, 2), jnp.float32)


@pytest.mark.parametrize("call, message", [
    (lambda: expand_quantize_fp8_rows(V[0], I, S, 8), r"expected values of rank 2 \[T, H\], got shape \(8,\)"),
    (lambda: expand_quantize_fp8_rows(V.astype(jnp.int32), I, S, 8), "expected values of dtype .*, got int32"),
    (lambda: expand_quantize_fp8_rows(V.astype(jnp.float8_e4m3fn), I, S, 8), "expected values of dtype .*, got float8_e4m3fn"),
    (lambda: expand_quantize_fp8_rows(V, I[0], S, 8), r"expected slots of rank 2 \[T, k\], got shape \(2,\)"),
    (lambda: expand_quantize_fp8_rows(V, I.astype(jnp.uint32), S, 8), "expected int32 slots, got uint32"),
    (lambda: expand_quantize_fp8_rows(V, I[:3], S[:3], 8), r"expected slots.shape\[0\] \(T of values \[T, H\]\) = 4, got 3"),
    (lambda: expand_quantize_fp8_rows(V, I, S.astype(jnp.bfloat16), 8), "expected float32 factor, got bfloat16"),
    (lambda: expand_quantize_fp8_rows(V, I, S[:, :1], 8), r"expected factor of shape \(4, 2\), got \(4, 1\)"),
    (lambda: expand_quantize_fp8_rows(V, I, S, -1), "expected num_rows to be an int in \\[0, 2\\^31\\), got -1"),
    (lambda: expand_quantize_fp8_rows(V, I, S, 8.0), "expected num_rows to be an int .*, got 8.0"),
    (lambda: expand_quantize_fp8_rows(V, I, S, 2 ** 31), "expected num_rows to be an int .*, got 2147483648"),
    (lambda: expand_quantize_fp8_rows(V, I, S, 8, pow2_scale=1), "expected pow2_scale to be a Python bool"),
])
def test_bad_inputs_raise_at_trace_time(call, message):
    with pytest.raises((TypeError, ValueError), match=f"expand_quantize_fp8_rows: {message}"):
        jax.eval_shape(call)


F8, F32, BF16 = jnp.float8_e4m3fn, jnp.float32, jnp.bfloat16
GOOD_ARGS = (((4, 16), BF16), ((4, 2), jnp.int32), ((4, 2), F32))
GOOD_RESULTS = (((6, 16), BF16), ((6, 16), F8), ((6, 1), F32))


def _replaced(items, index, new):
    return tuple(new if i == index else item for i, item in enumerate(items))


@pytest.mark.parametrize("args, results, message", [
    (_replaced(GOOD_ARGS, 0, ((64,), BF16)), GOOD_RESULTS, r"values: expected rank 2 \[T, H\], got shape \[64\]"),
    (_replaced(GOOD_ARGS, 0, ((4, 16), jnp.int32)), GOOD_RESULTS,
     "values: expected dtype float32, bfloat16 or float16, got int32"),
    (_replaced(GOOD_ARGS, 1, ((8,), jnp.int32)), GOOD_RESULTS, r"slots: expected rank 2 \[T, k\], got shape \[8\]"),
    (_replaced(GOOD_ARGS, 1, ((4, 2), F32)), GOOD_RESULTS, "slots: expected dtype int32, got float32"),
    (_replaced(GOOD_ARGS, 1, ((3, 2), jnp.int32)), GOOD_RESULTS, r"slots: expected shape \[4, 2\], got \[3, 2\]"),
    (_replaced(GOOD_ARGS, 2, ((4, 2), jnp.int32)), GOOD_RESULTS, "factor: expected float32, got int32"),
    (_replaced(GOOD_ARGS, 2, ((4, 1), F32)), GOOD_RESULTS, r"factor: expected shape \[4, 2\], got \[4, 1\]"),
    (GOOD_ARGS, _replaced(GOOD_RESULTS, 0, ((6, 16), F32)), "rows: expected dtype bfloat16, got float32"),
    (GOOD_ARGS, _replaced(GOOD_RESULTS, 0, ((6, 15), BF16)), r"rows: expected shape \[6, 16\], got \[6, 15\]"),
    (GOOD_ARGS, _replaced(GOOD_RESULTS, 1, ((6, 16), jnp.uint8)), "q: expected dtype float8_e4m3fn"),
    (GOOD_ARGS, _replaced(GOOD_RESULTS, 1, ((16, 6), F8)), r"q: expected shape \[6, 16\], got \[16, 6\]"),
    (GOOD_ARGS, _replaced(GOOD_RESULTS, 2, ((6, 2), F32)), r"scales: expected shape \[6, 1\], got \[6, 2\]"),
])
def test_handler_rejects_inconsistent_buffers(args, results, message):
    """The FFI handlers check what the primitive's shape rule already guarantees, for
    callers that reach the targets without it."""
    from moe_xla import _lib

    call = jax.ffi.ffi_call(_lib.require_kernel("expand_quantize_fp8_rows", "cpu"),
                            [jax.ShapeDtypeStruct(*r) for r in results])
    operands = [jnp.zeros(*a) for a in args]
    with jax.default_device(jax.devices("cpu")[0]), pytest.raises(Exception, match=message):
        jax.block_until_ready(jax.jit(lambda *a: call(*a, pow2_scale=False))(*operands))


def test_sharded_operands_give_the_one_device_result(rng):
    """Tokens split over devices (any token may fill any row): the op sees them whole and
    gives the one-device result."""
    if jax.device_count() < 2:
        pytest.skip("needs 2 devices")
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("d",))
    split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d"))
    values, slots, factor = _case(rng, 24, 4, 96, 300, jnp.float32, permutation=True)
    f = jax.jit(lambda *a: expand_quantize_fp8_rows(*a, 96))
    one = f(*jax.device_get((values, slots, factor)))
    out = f(*(jax.device_put(a, split) for a in (values, slots, factor)))
    assert_outputs_bitwise(out, one, "one device")
