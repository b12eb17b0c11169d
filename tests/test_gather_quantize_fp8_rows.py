"""gather_quantize_fp8_rows: scaled rows gathered through an index, fused with the FP8 row
quantisation.

The kernels (CPU everywhere, CUDA where there is a GPU) against the reference evaluated on
the CPU: rows bitwise (NaN where the reference is NaN: a NaN's sign and payload are the
platform's), q and scales bitwise. Data: every special case of the quantisation (tricky),
widths with tails and odd, no rows, no values, indices outside [0, T) (negative, T, huge)
and repeated, scales of 0, -0, negative, huge, subnormal, inf and NaN, and products at and
just below 2^-126, where XLA's CPU (denormals flushed) and gradual underflow round apart.
The reference against numpy; vmap (the batch folded into R, invalid indices kept invalid),
jit, eager, the reference lowering, sharding along R, errors.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from conftest import ON_GPU, requires_gpu
from test_fp8_quantize import _reference_on, assert_bitwise, tricky

from moe_xla import reference
from moe_xla.primitives.gather_quantize_fp8_rows import gather_quantize_fp8_rows, gather_quantize_fp8_rows_p

PLATFORMS = ["cpu", pytest.param("gpu", marks=requires_gpu)]
DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
# (T, R, H): H a multiple of 8 takes the CUDA kernel's vector accesses; tails of 128, an odd
# H, more rows than values (repeats), no rows, no values, no columns.
SHAPES = [(37, 50, 256), (5, 40, 300), (64, 64, 136), (3, 9, 7), (10, 0, 128), (0, 6, 130), (6, 4, 0)]
MIN_NORMAL = 2.0 ** -126


def _tiny_products(rng, dtype):
    """(scale, value) pairs, value of dtype, whose products lie at 2^-126: two whose exact
    product is in 2^-126 [1 - 2^-24, 1 - 2^-25), which gradual underflow rounds up to 2^-126
    and XLA's CPU flushes to 0; one of exactly 2^-126; one a float32 ulp above (kept)."""
    value = np.unique(rng.uniform(1, 2, 2048).astype(jnp.dtype(dtype))).astype(np.float64) * 2.0 ** -6
    near = (MIN_NORMAL / value).astype(np.float32).view(np.uint32)
    scale = (near[:, None].astype(np.int64) + np.arange(-2, 3)).astype(np.uint32).view(np.float32)
    exact = scale.astype(np.float64) * value[:, None]
    i, j = np.nonzero((exact >= MIN_NORMAL * (1 - 2.0 ** -24)) & (exact < MIN_NORMAL * (1 - 2.0 ** -25)))
    assert i.size >= 2, "no product between the two roundings"
    pairs = [(scale[i[k], j[k]], value[i[k]]) for k in range(2)]
    return pairs + [(np.float32(2.0 ** -120), 2.0 ** -6), (np.nextafter(np.float32(2.0 ** -120), np.inf), 2.0 ** -6)]


def _case(rng, t, r, h, dtype):
    """(values, src, scale) with the special cases of the module docstring."""
    values = np.array(tricky(rng, (t, h), dtype))
    src = rng.integers(0, max(t, 1), r).astype(np.int64)
    invalid = np.array([-1, t, t + 1, -(2 ** 31), 2 ** 31 - 1, -7], np.int64)
    src[5: 5 + invalid.size] = invalid[: max(0, r - 5)]
    if r > 12:
        src[11:13] = src[0]  # repeated next to unrelated rows
    scale = (rng.standard_normal(r) * np.exp(rng.uniform(-8, 8, r))).astype(np.float32)
    special = np.array([0.0, -0.0, -1.0, 3e38, -1e30, 1e-40, MIN_NORMAL, np.inf, np.nan], np.float32)
    scale[13: 13 + special.size] = special[: max(0, r - 13)]
    if t and h >= 4 and r >= 4:
        for k, (s, v) in enumerate(_tiny_products(rng, dtype)):
            values[0, k] = v
            src[k], scale[k] = 0, s
    return jnp.asarray(values), jnp.asarray(src, jnp.int32), jnp.asarray(scale)


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


def _reference_on_cpu(values, src, scale, pow2=False):
    return _reference_on("cpu", lambda a: reference.gather_quantize_fp8_rows(*a, pow2_scale=pow2),
                         (values, src, scale))


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_kernel_is_the_reference_bitwise(rng, shape, dtype, pow2, platform):
    t, r, h = shape
    values, src, scale = _case(rng, t, r, h, dtype)
    out = jax.jit(lambda *a: gather_quantize_fp8_rows(*a, pow2_scale=pow2))(*_on(platform, values, src, scale))
    assert out[0].shape == (r, h) and out[0].dtype == values.dtype and out[1].shape == (r, h)
    assert out[2].shape == (r, -(-h // 128))
    want = _reference_on_cpu(values, src, scale, pow2)
    assert_outputs_bitwise(out, want, "the reference on the CPU")
    # The contract's own claims: rows of no value are zero rows, q and scales those of the
    # rows returned.
    named = np.asarray((src >= 0) & (src < t))
    assert np.all(_bits(out[0])[~named] == 0) and np.all(np.asarray(out[2])[~named] == 1.0)
    assert_bitwise(out[1:], _reference_on("cpu", reference.quantize_fp8_rows, jax.device_get(out[0]),
                                          pow2_scale=pow2), "quantize_fp8_rows of the returned rows")


@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_is_the_contract_in_numpy(rng, dtype):
    """reference.gather_quantize_fp8_rows against the rule written out in numpy, whose
    float32 product underflows gradually: operands' float32 subnormals count as zeros,
    products of magnitude at most 2^-126 are zeros of their sign, one rounding to the
    dtype; on the CPU, whose flushing would hide a reference that left it to the FPU."""
    t, r, h = 7, 40, 130
    values, src, scale = _case(rng, t, r, h, dtype)
    x = np.asarray(values, np.float32)[np.clip(np.asarray(src), 0, t - 1)]
    s = np.asarray(scale)[:, None]

    def flushed(v, limit):
        return np.where(np.abs(v) <= limit, np.copysign(np.float32(0), v), v).astype(np.float32)

    with np.errstate(invalid="ignore", over="ignore", under="ignore"):
        tiny = np.nextafter(np.float32(MIN_NORMAL), np.float32(0))
        product = flushed(flushed(s, tiny) * flushed(x, tiny), np.float32(MIN_NORMAL))
        named = ((np.asarray(src) >= 0) & (np.asarray(src) < t))[:, None]
        rows = np.where(named, product, np.float32(0)).astype(jnp.dtype(dtype))
    got = _reference_on_cpu(values, src, scale)
    assert_rows_bitwise(got[0], rows, "numpy")
    assert_bitwise(got[1:], _reference_on("cpu", reference.quantize_fp8_rows, rows), "quantize_fp8_rows of numpy's")


@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_are_the_unfused_products_away_from_the_smallest_normal(rng, dtype):
    """Away from products of magnitude at most 2^-126 the rows are the plain jnp of a
    weighted row gather (the float32 product, one rounding to the dtype)."""
    values, src, scale = _case(rng, 11, 60, 200, dtype)
    scale = scale.at[:4].set(1.0)  # no tiny products

    def unfused(v, i, s):
        named = (i >= 0) & (i < v.shape[0])
        x = v[jnp.clip(i, 0, v.shape[0] - 1)].astype(jnp.float32)
        return jnp.where(named[:, None], s[:, None] * x, 0).astype(v.dtype)

    want = _reference_on("cpu", lambda a: unfused(*a), (values, src, scale))
    assert_rows_bitwise(_reference_on_cpu(values, src, scale)[0], want, "the unfused jnp")


def test_invalid_indices_read_nothing_and_give_zero_rows(rng):
    """Every src outside [0, T), any scale: rows +0, q 0, scales 1; an empty values array too."""
    src = jnp.asarray([-1, 3, 4, -(2 ** 31), 2 ** 31 - 1, 1000], jnp.int32)
    scale = jnp.asarray([1.0, np.nan, np.inf, -2.0, 0.0, 1e30], jnp.float32)
    for values in (tricky(rng, (3, 260), jnp.bfloat16), jnp.zeros((0, 260), jnp.bfloat16)):
        rows, q, scales = jax.jit(gather_quantize_fp8_rows)(values, src, scale)
        assert np.all(_bits(rows) == 0) and np.all(_bits(q) == 0)
        np.testing.assert_array_equal(np.asarray(scales), np.ones((6, 3), np.float32))


def _per_batch(values, src, scale, pow2=False):
    """The op on each batch entry, stacked (every argument batched along axis 0)."""
    outs = [jax.jit(lambda *a: gather_quantize_fp8_rows(*a, pow2_scale=pow2))(values[b], src[b], scale[b])
            for b in range(src.shape[0])]
    return [jnp.stack(o) for o in zip(*outs)]


def _batch_of_cases(rng, b, t, r, h, dtype):
    cases = [_case(rng, t, r, h, dtype) for _ in range(b)]
    return [jnp.stack(a) for a in zip(*cases)]


def test_vmap_folds_the_batch_and_keeps_invalid_indices_invalid(rng):
    """Batch entry b's src indexes its own values; T itself, negative and huge entries stay
    zero rows instead of naming the next entry's rows."""
    values, src, scale = _batch_of_cases(rng, 3, 9, 30, 140, jnp.bfloat16)
    src = src.at[:, 20].set(9).at[:, 21].set(-1).at[:, 22].set(2 ** 31 - 1).at[:, 23].set(18)
    want = _per_batch(values, src, scale, True)
    f = jax.vmap(lambda *a: gather_quantize_fp8_rows(*a, pow2_scale=True))
    assert_outputs_bitwise(f(values, src, scale), want, "the op per batch entry")
    moved = jax.vmap(gather_quantize_fp8_rows, in_axes=(1, 1, 0), out_axes=(1, 0, 2))(
        jnp.swapaxes(values, 0, 1), src.T, scale)
    want = _per_batch(values, src, scale)
    assert_outputs_bitwise((jnp.swapaxes(moved[0], 0, 1), moved[1], jnp.moveaxis(moved[2], 2, 0)), want,
                           "the op per batch entry")
    # The batching rule on its own: output shapes and batch dimensions.
    bound = jax.vmap(lambda *a: gather_quantize_fp8_rows_p.bind(*a, pow2_scale=False))(values, src, scale)
    assert [a.shape for a in bound] == [(3, 30, 140), (3, 30, 140), (3, 30, 2)]


def test_vmap_with_unbatched_operands(rng):
    values, src, scale = _batch_of_cases(rng, 4, 6, 20, 130, jnp.float32)
    b = src.shape[0]
    # One values array for every entry: the batch folds into R alone.
    out = jax.vmap(gather_quantize_fp8_rows, in_axes=(None, 0, 0))(values[0], src, scale)
    assert_outputs_bitwise(out, _per_batch(jnp.stack([values[0]] * b), src, scale), "the op per batch entry")
    # Batched values, one src and scale for all.
    out = jax.vmap(gather_quantize_fp8_rows, in_axes=(0, None, None))(values, src[1], scale[1])
    assert_outputs_bitwise(out, _per_batch(values, jnp.stack([src[1]] * b), jnp.stack([scale[1]] * b)),
                           "the op per batch entry")
    # Batched scale only.
    out = jax.vmap(gather_quantize_fp8_rows, in_axes=(None, None, 0))(values[0], src[0], scale)
    assert_outputs_bitwise(out, _per_batch(jnp.stack([values[0]] * b), jnp.stack([src[0]] * b), scale),
                           "the op per batch entry")


def test_eager_and_reference_lowering_are_the_kernel(monkeypatch, rng):
    """The eager call and MOE_XLA_IMPL=reference (on the CPU: XLA:GPU's division may round
    the reference's scales apart, test_fp8_quantize says) give the jitted kernel's bits."""
    args = _on("cpu", *_case(rng, 12, 33, 300, jnp.bfloat16))
    kernel = jax.jit(gather_quantize_fp8_rows)(*args)
    assert_outputs_bitwise(gather_quantize_fp8_rows(*args), kernel, "the jitted kernel")
    monkeypatch.setenv("MOE_XLA_IMPL", "reference")
    f = jax.jit(lambda *a: gather_quantize_fp8_rows(*a))  # a fresh jit: MOE_XLA_IMPL is read while lowering
    assert "moe_xla_gather_quantize_fp8_rows" not in f.lower(*args).as_text()
    assert_outputs_bitwise(f(*args), kernel, "the kernel")


def test_lowers_to_one_versioned_call():
    platform = "cuda" if ON_GPU else "cpu"
    text = jax.jit(gather_quantize_fp8_rows).lower(jnp.zeros((8, 256), jnp.bfloat16), jnp.zeros((16,), jnp.int32),
                                                   jnp.zeros((16,), jnp.float32)).as_text()
    assert text.count(f"moe_xla_gather_quantize_fp8_rows_{platform}_v1") == 1
    assert "moe_xla_quantize_fp8_rows" not in text and "gather" not in text.replace("gather_quantize", "")


def test_not_differentiable_but_stop_gradient_works():
    values, src, scale = jnp.ones((4, 130)), jnp.arange(6, dtype=jnp.int32) - 1, jnp.ones((6,))
    loss = lambda v: jnp.sum(gather_quantize_fp8_rows(v, src, scale)[0])  # noqa: E731
    with pytest.raises(TypeError, match="gather_quantize_fp8_rows is not differentiable"):
        jax.grad(loss)(values)
    grad = jax.grad(lambda v: loss(jax.lax.stop_gradient(v)) + jnp.sum(v))(values)
    assert np.all(np.asarray(grad) == 1.0)


V, I, S = jnp.zeros((4, 8)), jnp.zeros((5,), jnp.int32), jnp.zeros((5,), jnp.float32)


@pytest.mark.parametrize("call, message", [
    (lambda: gather_quantize_fp8_rows(V[0], I, S), r"expected values of rank 2 \[T, H\], got shape \(8,\)"),
    (lambda: gather_quantize_fp8_rows(V.astype(jnp.int32), I, S), "expected values of dtype .*, got int32"),
    (lambda: gather_quantize_fp8_rows(V.astype(jnp.float8_e4m3fn), I, S), "got float8_e4m3fn"),
    (lambda: gather_quantize_fp8_rows(V, I[None], S), r"expected src of rank 1 \[R\], got shape \(1, 5\)"),
    (lambda: gather_quantize_fp8_rows(V, I.astype(jnp.uint32), S), "expected int32 src, got uint32"),
    (lambda: gather_quantize_fp8_rows(V, I, S.astype(jnp.bfloat16)), "expected float32 scale, got bfloat16"),
    (lambda: gather_quantize_fp8_rows(V, I, S[:4]), r"expected scale of shape \(5,\), got \(4,\)"),
    (lambda: gather_quantize_fp8_rows(V, I, S[None]), r"expected scale of shape \(5,\), got \(1, 5\)"),
    (lambda: gather_quantize_fp8_rows(V, I, S, pow2_scale=1), "expected pow2_scale to be a Python bool"),
])
def test_bad_inputs_raise_at_trace_time(call, message):
    with pytest.raises((TypeError, ValueError), match=message):
        jax.eval_shape(call)


F8, F32, BF16 = jnp.float8_e4m3fn, jnp.float32, jnp.bfloat16
GOOD_ARGS = (((4, 16), BF16), ((6,), jnp.int32), ((6,), F32))
GOOD_RESULTS = (((6, 16), BF16), ((6, 16), F8), ((6, 1), F32))


def _replaced(items, index, new):
    return tuple(new if i == index else item for i, item in enumerate(items))


@pytest.mark.parametrize("args, results, message", [
    (_replaced(GOOD_ARGS, 0, ((64,), BF16)), GOOD_RESULTS, r"values: expected rank 2 \[T, H\], got shape \[64\]"),
    (_replaced(GOOD_ARGS, 0, ((4, 16), jnp.int32)), GOOD_RESULTS,
     "values: expected dtype float32, bfloat16 or float16, got int32"),
    (_replaced(GOOD_ARGS, 1, ((6, 1), jnp.int32)), GOOD_RESULTS, r"src: expected rank 1 \[R\], got shape \[6, 1\]"),
    (_replaced(GOOD_ARGS, 1, ((6,), F32)), GOOD_RESULTS, "src: expected dtype int32, got float32"),
    (_replaced(GOOD_ARGS, 2, ((6,), jnp.int32)), GOOD_RESULTS, "scale: expected dtype float32, got int32"),
    (_replaced(GOOD_ARGS, 2, ((5,), F32)), GOOD_RESULTS, r"scale: expected shape \[6\], got \[5\]"),
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

    call = jax.ffi.ffi_call(_lib.require_kernel("gather_quantize_fp8_rows", "cpu"),
                            [jax.ShapeDtypeStruct(*r) for r in results])
    operands = [jnp.zeros(*a) for a in args]
    with jax.default_device(jax.devices("cpu")[0]), pytest.raises(Exception, match=message):
        jax.block_until_ready(jax.jit(lambda *a: call(*a, pow2_scale=False))(*operands))


def test_shards_along_rows_without_gathering(rng):
    """src and scale split along R, values replicated: each device gathers its own rows, no
    collective; values split along T are gathered first (any row may be named)."""
    if jax.device_count() < 2:
        pytest.skip("needs 2 devices")
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("d",))
    split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d"))
    whole = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    values, src, scale = _case(rng, 24, 64, 300, jnp.float32)
    one = jax.jit(gather_quantize_fp8_rows)(*jax.device_get((values, src, scale)))
    f = jax.jit(gather_quantize_fp8_rows)
    args = (jax.device_put(values, whole), jax.device_put(src, split), jax.device_put(scale, split))
    hlo = f.lower(*args).compile().as_text()
    assert "all-gather" not in hlo and "all-to-all" not in hlo and "collective-permute" not in hlo
    out = f(*args)
    assert all(o.sharding.spec[0] == "d" for o in out)
    assert_outputs_bitwise(out, one, "one device")
    out = f(jax.device_put(values, split), *args[1:])
    assert_outputs_bitwise(out, one, "one device")
