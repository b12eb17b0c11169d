"""FP8 blockwise quantisation (common/fp8_blockwise.h): the kernels bitwise against the
reference, the reference bitwise against numpy, and the primitives' rules and errors; the
weights' two layouts in one call (quantize_fp8_weight_layouts, behind
moe_xla.quantize_fp8_weights) bitwise the blocks and their transpose.

The kernel comparisons run on the CPU everywhere and on the GPU where there is one,
against the reference evaluated on the CPU. Data: random rows
of magnitudes 1e-4 .. 1e4, K and N not multiples of 128, odd M, and tiles of zeros, of
subnormals only, of NaN / +-inf only, with NaN, +-inf, huge values and subnormals
scattered, and E4M3 rounding ties with their float32 neighbours.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from conftest import ON_GPU, requires_gpu

import moe_xla
from moe_xla import reference
from moe_xla.primitives.quantize_fp8_weight_layouts import quantize_fp8_weight_layouts, quantize_fp8_weight_layouts_p

DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
PLATFORMS = ["cpu", pytest.param("gpu", marks=requires_gpu)]
# Widths that are multiples of 8 take the CUDA kernel's vector accesses, the others its
# element-wise path; both with partial tiles.
ROW_SHAPES = [(7, 300), (1, 128), (33, 1), (5, 259), (257, 1000), (4, 0), (0, 5)]
BLOCK_SHAPES = [(3, 130, 260), (1, 128, 128), (2, 1, 7), (1, 300, 129), (2, 272, 392), (0, 4, 4)]
# The weights' two layouts: the blocks' shapes and empty K or N (q_t [G, N, K] of size 0 too).
WEIGHT_SHAPES = BLOCK_SHAPES + [(2, 0, 130), (2, 130, 0)]


def _device(platform):
    return jax.devices(platform)[0]


def _ties():
    """E4M3 rounding ties at scale 1 (a tile whose amax is 448) and their float32 neighbours."""
    mids = np.array([1.0625, 2.0 ** -10, 3 * 2.0 ** -10, 17.0, 19.0, 464.0, 0.5 + 2.0 ** -5], np.float32)
    up = np.nextafter(mids, np.float32(np.inf))
    down = np.nextafter(mids, np.float32(0))
    return np.concatenate([[448.0], mids, up, down, -mids, -up, -down]).astype(np.float32)


def tricky(rng, shape, dtype):
    """Random data with every special case of the contract (see the module docstring)."""
    x = rng.standard_normal(shape) * np.exp(rng.uniform(-9, 9, size=shape[:-1] + (1,)))
    flat = x.reshape(-1)
    if flat.size:
        specials = [np.nan, -np.nan, np.inf, -np.inf, 3e38, -1e30, 1e-40, -2e-39, 0.0, -0.0]
        idx = rng.choice(flat.size, size=min(flat.size, 4 * len(specials)), replace=False)
        flat[idx] = np.resize(specials, idx.size)
    rows = x.reshape(-1, shape[-1]) if x.size else np.zeros((0, 0))
    if rows.shape[0] >= 5:
        rows[0, :128] = 0.0                                   # a zero tile (scale 1)
        rows[1, :128] = rng.uniform(-1e-38, 1e-38, rows[1, :128].shape) * 1e-1  # subnormals only
        rows[2, :128] = np.resize([np.nan, np.inf, -np.inf], rows[2, :128].size)  # no finite value
        ties = _ties()[: rows.shape[1]] if dtype == jnp.float32 else np.array([448.0, 17.0, -19.0])[: rows.shape[1]]
        rows[3, :128] = 0.0
        rows[3, : ties.size] = ties
        # A tiny normal amax (scale 2^-126) beside subnormals, which must quantise to zero:
        # divided unflushed they would give 0.5 (the CPU's flush-to-zero mode would hide that).
        rows[4, :128] = 0.0
        tiny = np.array([2.0 ** -120, 2.0 ** -127, -(2.0 ** -127), 3 * 2.0 ** -128])[: rows.shape[1]]
        rows[4, : tiny.size] = tiny
    with np.errstate(over="ignore"):  # huge values become inf in float16
        return jnp.asarray(x.astype(jnp.dtype(dtype)))


def _bits(a):
    a = np.asarray(a)
    return a.view(f"uint{8 * a.dtype.itemsize}")


def assert_bitwise(out, ref, against="the reference", names=None):
    """Every output bitwise its reference, NaN payloads included: (q, scales), or (q, q_t,
    scales) of the weights, or the outputs `names` lists."""
    assert len(out) == len(ref), (len(out), len(ref))
    names = names or (("q", "scales") if len(out) == 2 else ("q", "q_t", "scales"))
    for o, r, name in zip(out, ref, names):
        assert o.shape == r.shape and o.dtype == r.dtype, (name, o.shape, o.dtype, r.shape, r.dtype)
        ob, rb = _bits(o), _bits(r)
        bad = np.argwhere(ob != rb)
        if bad.size:
            first = tuple(bad[0])
            raise AssertionError(f"{name}: {len(bad)} of {ob.size} differ from {against}, first at {first}: "
                                 f"{ob[first]:#x} vs {rb[first]:#x}")


def _reference_on(platform, fn, x, **kw):
    with jax.default_device(_device(platform)):
        return jax.jit(lambda v: fn(v, **kw))(jax.device_put(x, _device(platform)))


def _numpy_quantize(x, scales_per_element):
    """The contract in numpy (no flushing of subnormals by the FPU): q per element."""
    x = np.asarray(x, np.float32).copy()
    tiny = np.abs(x) < np.float32(2.0 ** -126)
    x[tiny] = np.copysign(np.float32(0), x[tiny])
    with np.errstate(invalid="ignore", over="ignore"):
        v = np.clip(x / scales_per_element, -448, 448)
    q = v.astype(ml_dtypes.float8_e4m3fn)
    return np.where(np.isnan(x), np.uint8(0x7F).view(ml_dtypes.float8_e4m3fn), q)


def _numpy_scale(amax, pow2):
    with np.errstate(under="ignore"):
        s = np.maximum(np.float32(amax) / np.float32(448), np.float32(2.0 ** -126)).astype(np.float32)
    if pow2:
        s = np.exp2(np.ceil(np.log2(s.astype(np.float64)))).astype(np.float32)
    return np.where(amax == 0, np.float32(1), s).astype(np.float32)


def _numpy_magnitude(x):
    a = np.abs(np.asarray(x, np.float32))
    return np.where(np.isfinite(a) & (a >= np.float32(2.0 ** -126)), a, np.float32(0))


# (op, its reference, input shape): rows of [M, K], blocks and weights of [G, K, N].
KERNEL_CASES = [pytest.param(moe_xla.quantize_fp8_rows, reference.quantize_fp8_rows, s, id=f"rows{s}")
                for s in ROW_SHAPES] + [
                pytest.param(moe_xla.quantize_fp8_blocks, reference.quantize_fp8_blocks, s, id=f"blocks{s}")
                for s in BLOCK_SHAPES] + [
                pytest.param(quantize_fp8_weight_layouts, reference.quantize_fp8_weight_layouts, s,
                             id=f"weights{s}")
                for s in WEIGHT_SHAPES]


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op, ref, shape", KERNEL_CASES)
def test_kernel_is_the_reference_bitwise(rng, op, ref, shape, dtype, pow2, platform):
    x = tricky(rng, shape, dtype)
    out = jax.jit(lambda v: op(v, pow2_scale=pow2))(jax.device_put(x, _device(platform)))
    # The oracle is the reference evaluated by XLA:CPU, whose float32 division is IEEE. On
    # the H200, XLA:GPU's division in the reference gave scales one ulp off fl(amax / 448)
    # (jax 0.11.2) while the CUDA kernel matched the CPU reference bit for bit.
    assert_bitwise(out, _reference_on("cpu", ref, x, pow2_scale=pow2), "the reference on the CPU")


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", WEIGHT_SHAPES, ids=str)
def test_weight_layouts_are_the_blocks_and_their_transpose(rng, shape, dtype, pow2, platform):
    """One call writes q and scales bitwise those of quantize_fp8_blocks on the same
    platform, and q_t bitwise q with its last two axes swapped; quantize_fp8_weights returns
    them as the Fp8Weights that the blocks and XLA's transpose made before."""
    w = jax.device_put(tricky(rng, shape, dtype), _device(platform))
    q, s = jax.jit(lambda v: moe_xla.quantize_fp8_blocks(v, pow2_scale=pow2))(w)
    want = (q, jnp.swapaxes(q, 1, 2), s)
    assert_bitwise(jax.jit(lambda v: quantize_fp8_weight_layouts(v, pow2_scale=pow2))(w), want,
                   "quantize_fp8_blocks and its transpose")
    weights = jax.jit(lambda v: moe_xla.quantize_fp8_weights(v, pow2_scale=pow2))(w)
    assert isinstance(weights, moe_xla.Fp8Weights)
    assert_bitwise(weights, want, "quantize_fp8_blocks and its transpose")


def test_quantize_fp8_weights_is_one_call_without_a_transpose():
    """Both layouts come from the kernel: no blocks call and no XLA transpose beside it."""
    platform = "cuda" if ON_GPU else "cpu"
    text = jax.jit(moe_xla.quantize_fp8_weights).lower(jnp.zeros((2, 256, 384), jnp.bfloat16)).as_text()
    assert text.count(f"moe_xla_quantize_fp8_weights_{platform}_v1") == 1
    assert "quantize_fp8_blocks" not in text and "transpose" not in text


def test_weight_layouts_reference_lowering_is_the_kernel_bitwise(monkeypatch, rng):
    """MOE_XLA_IMPL=reference lowers the op to reference.quantize_fp8_weight_layouts (on the
    CPU: XLA:GPU's division may round the reference's scales apart, see above)."""
    w = jax.device_put(tricky(rng, (2, 130, 260), jnp.bfloat16), _device("cpu"))
    kernel = jax.jit(quantize_fp8_weight_layouts)(w)
    monkeypatch.setenv("MOE_XLA_IMPL", "reference")
    f = jax.jit(lambda v: quantize_fp8_weight_layouts(v))  # a fresh jit: MOE_XLA_IMPL is read while lowering
    assert "moe_xla_quantize_fp8_weights" not in f.lower(w).as_text()
    assert_bitwise(f(w), kernel, "the kernel")


# E4M3 rounding boundaries: halfway between two neighbouring E4M3 values (3-bit mantissas).
_MIDPOINTS = np.array([0.53125, 1.0625, 1.1875, 3.125, 17.0, 19.0, 100.0, 432.0], np.float32)


def _near_boundaries(rng, tiles, dtype):
    """[tiles, 128] rows of x's dtype whose quotients x / scale (float32, scale =
    fl(amax / 448) of the row, with a random mantissa: not a power of two, so x * (1 / scale)
    and x / scale can round apart) lie within 4 float32 ulps of an E4M3 rounding boundary:
    element 0 is the row's amax, the others, with random signs, the values of x's dtype
    within 8 steps of fl(B * scale), B a boundary, whose quotient is that close (bf16's
    steps are 2^16 float32 ulps wide, so few are: rows come from many random amax)."""
    dt = jnp.dtype(dtype)
    uint = np.uint32 if dt.itemsize == 4 else np.uint16
    n = 4 * tiles if dt.itemsize == 4 else 256 * tiles
    amax = (rng.uniform(1, 2, n) * np.exp2(rng.integers(-20, 20, n))).astype(dt).astype(np.float32)
    scale = np.maximum(amax / np.float32(448), np.float32(2.0 ** -126))
    start = (_MIDPOINTS[None, :] * scale[:, None]).astype(dt).view(uint).astype(np.int64)
    cand = (start[..., None] + np.arange(-8, 9)).astype(uint).view(dt).reshape(n, -1)  # [n, 8 * 17]
    quotient = cand.astype(np.float32) / scale[:, None]
    ulps = np.abs(quotient.view(np.int32).astype(np.int64)[:, :, None] - _MIDPOINTS.view(np.int32)).min(axis=-1)
    near = ulps <= 4
    picked = np.flatnonzero(near.any(axis=1))[:tiles]
    assert picked.size == tiles, f"only {picked.size} rows with a quotient near a boundary"
    values = np.stack([np.resize(cand[i][near[i]], 127) for i in picked])
    signs = rng.choice([-1, 1], (tiles, 127)).astype(dt)
    return np.concatenate([amax[picked, None].astype(dt), values * signs], axis=1)


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_quotients_near_e4m3_boundaries_round_as_the_division(rng, dtype, platform):
    """Rows, and 128 x 128 blocks (each one such row repeated: one scale per block), whose
    quotients lie within a few float32 ulps of E4M3 rounding boundaries round bitwise as the
    reference's single division: a guard against computing x * (1 / scale), which rounds
    twice (LOG.md, session 11, tried it on the GPU kernels)."""
    rows = _near_boundaries(rng, 128, dtype)
    blocks = np.stack([np.resize(row, (128, 128)) for row in rows[:4]])
    for op, ref, arg in ((moe_xla.quantize_fp8_rows, reference.quantize_fp8_rows, rows),
                         (moe_xla.quantize_fp8_blocks, reference.quantize_fp8_blocks, blocks),
                         (quantize_fp8_weight_layouts, reference.quantize_fp8_weight_layouts, blocks)):
        arg = jnp.asarray(arg)
        out = jax.jit(op)(jax.device_put(arg, _device(platform)))
        assert_bitwise(out, _reference_on("cpu", ref, arg), "the reference on the CPU")


@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_is_the_contract_in_numpy(rng, dtype, pow2):
    """reference.py against the rules written out in numpy (numpy never flushes subnormals;
    XLA's CPU does, which the contract's rules make irrelevant)."""
    x = tricky(rng, (37, 300), dtype)
    x32 = np.asarray(x.astype(jnp.float32))
    k = x32.shape[1]
    padded = np.pad(x32, ((0, 0), (0, 384 - k))).reshape(37, 3, 128)
    scales = _numpy_scale(_numpy_magnitude(padded).max(axis=-1), pow2)
    q = _numpy_quantize(x32, np.repeat(scales, 128, axis=1)[:, :k])
    assert_bitwise(_reference_on("cpu", reference.quantize_fp8_rows, x, pow2_scale=pow2), (q, scales))

    w = tricky(rng, (2, 130, 200), dtype)
    w32 = np.asarray(w.astype(jnp.float32))
    padded = np.pad(w32, ((0, 0), (0, 126), (0, 56))).reshape(2, 2, 128, 2, 128)
    scales = _numpy_scale(_numpy_magnitude(padded).max(axis=(2, 4)), pow2)
    per_element = np.repeat(np.repeat(scales, 128, axis=1), 128, axis=2)[:, :130, :200]
    assert_bitwise(_reference_on("cpu", reference.quantize_fp8_blocks, w, pow2_scale=pow2),
                   (_numpy_quantize(w32, per_element), scales))


def test_group_col_tiles_restart_at_group_boundaries(rng):
    """The wgrad tiling: 128-row tiles from each group's first row (rows past the last group
    form one more segment), written transposed: row start + i of a segment whose first
    tile is t0 is column 128 t0 + i of q_t. Every scale is its tile's, unused scale rows
    are 1, columns of no row 0; dequantize_fp8_group_cols reads the same layout back."""
    m, k = 400, 6
    group_sizes = np.array([0, 130, 3, 200], np.int32)
    x = tricky(rng, (m, k), jnp.float32)
    # On the CPU, as the other checks of the reference against numpy: XLA:GPU's scatter
    # fusion gave scales one ulp above fl(amax / 448) (H200, jax 0.11.2).
    cols = lambda v: reference.quantize_fp8_group_cols(v, jnp.asarray(group_sizes))  # noqa: E731
    q_t, scales = (np.asarray(a) for a in _reference_on("cpu", cols, x))
    starts = [0, 0, 130, 133, 333]
    ends = [0, 130, 133, 333, 400]
    tile_rows = [range(s, min(s + 128, e)) for s, e in zip(starts, ends) for s in range(s, e, 128)]
    tiles = -(-m // 128) + 4
    assert scales.shape == (tiles, k) and q_t.shape == (k, 128 * tiles) and len(tile_rows) == 6
    x32 = np.asarray(x)
    for t, rows in enumerate(tile_rows):
        want = _numpy_scale(_numpy_magnitude(x32[list(rows)]).max(axis=0), False)
        np.testing.assert_array_equal(_bits(scales[t]), _bits(want))
        block = q_t[:, 128 * t: 128 * (t + 1)]
        np.testing.assert_array_equal(_bits(block[:, :len(rows)]).T, _bits(_numpy_quantize(x32[list(rows)], want)))
        np.testing.assert_array_equal(_bits(block[:, len(rows):]), 0)
    np.testing.assert_array_equal(np.asarray(scales[len(tile_rows):]), 1.0)
    np.testing.assert_array_equal(_bits(q_t[:, 128 * len(tile_rows):]), 0)
    back = np.asarray(reference.dequantize_fp8_group_cols(q_t, scales, jnp.asarray(group_sizes), m))
    finite = np.isfinite(x32) & (np.abs(x32) < 1e30)
    per_row = np.stack([scales[t] for t, rows in enumerate(tile_rows) for _ in rows])
    assert np.all(np.abs(back - x32)[finite] <= (16 * per_row)[finite])


def test_dequantized_values_are_within_half_an_e4m3_step(rng):
    x = jnp.asarray(rng.standard_normal((5, 300)) * 3.0, jnp.float32)
    q, s = moe_xla.quantize_fp8_rows(x)
    err = np.abs(np.asarray(reference.dequantize_fp8_rows(q, s)) - np.asarray(x))
    step = np.repeat(np.asarray(s), 128, axis=1)[:, :300] * 16  # half the E4M3 spacing at 256..448
    assert np.all(err <= step * (1 + 1e-6))
    w = jnp.asarray(rng.standard_normal((2, 130, 140)), jnp.float32)
    q, s = moe_xla.quantize_fp8_blocks(w)
    assert np.max(np.abs(np.asarray(reference.dequantize_fp8_blocks(q, s) - w))) <= np.max(np.asarray(s)) * 16


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_public_dequantize_is_the_numpy_product(rng, dtype):
    """moe_xla.dequantize_fp8_rows: q * its tile's scale in float32 (numpy, independent of
    the reference), then rounded to the dtype; a K tail (300 = 2 * 128 + 44) included."""
    x = tricky(rng, (7, 300), jnp.bfloat16)
    q, s = moe_xla.quantize_fp8_rows(x)
    want = (np.asarray(q).astype(np.float32) * np.repeat(np.asarray(s), 128, axis=1)[:, :300]).astype(dtype)
    got = jax.jit(moe_xla.dequantize_fp8_rows, static_argnums=2)(q, s, dtype)
    assert got.dtype == dtype
    np.testing.assert_array_equal(np.asarray(got, np.float32), want.astype(np.float32))  # NaN as NaN
    with pytest.raises(ValueError, match=r"scales \[M, ceil\(K/128\)\], got q \(7, 300\) and scales \(7, 2\)"):
        moe_xla.dequantize_fp8_rows(q, s[:, :2])
    with pytest.raises(TypeError, match="expected float8_e4m3fn q and float32 scales, got bfloat16"):
        moe_xla.dequantize_fp8_rows(q.astype(jnp.bfloat16), s)


def test_leading_dims_vmap_and_eager_agree(rng):
    x = tricky(rng, (3, 5, 200), jnp.bfloat16)
    q, s = moe_xla.quantize_fp8_rows(x)
    assert q.shape == (3, 5, 200) and s.shape == (3, 5, 2)
    for b in range(3):
        assert_bitwise(jax.jit(moe_xla.quantize_fp8_rows)(x[b]), (q[b], s[b]))
    assert_bitwise(jax.vmap(moe_xla.quantize_fp8_rows, in_axes=1, out_axes=1)(x), (q, s))

    w = tricky(rng, (2, 3, 130, 129), jnp.float32)
    q, s = jax.vmap(moe_xla.quantize_fp8_blocks)(w)
    assert q.shape == w.shape and s.shape == (2, 3, 2, 2)
    assert_bitwise(moe_xla.quantize_fp8_blocks(w), (q, s))
    assert_bitwise(moe_xla.quantize_fp8_blocks(w[1, 2]), (q[1, 2], s[1, 2]))

    # The weights' layouts: the batch folds into G; q_t is q transposed per element.
    layouts = jax.vmap(quantize_fp8_weight_layouts)(w)
    assert layouts[1].shape == (2, 3, 129, 130)
    assert_bitwise(layouts, (q, jnp.swapaxes(q, -1, -2), s))
    assert_bitwise(quantize_fp8_weight_layouts(w), layouts)
    assert_bitwise(jax.jit(quantize_fp8_weight_layouts)(w[1, 2]), tuple(a[1, 2] for a in layouts))
    moved = jax.vmap(quantize_fp8_weight_layouts, in_axes=1, out_axes=(2, 0, 1))(w)
    assert_bitwise((jnp.moveaxis(moved[0], 2, 1), jnp.swapaxes(moved[1], 0, 1), moved[2]), layouts)
    assert_bitwise(jax.vmap(moe_xla.quantize_fp8_weights)(w), layouts)
    # The batching rule on its own: the wrapper's reshapes would hide outputs of the wrong shape.
    bound = jax.vmap(lambda v: quantize_fp8_weight_layouts_p.bind(v, pow2_scale=False))(w)
    assert [a.shape for a in bound] == [a.shape for a in layouts]
    assert_bitwise(bound, layouts)


def test_lowers_to_the_versioned_targets():
    platform = "cuda" if ON_GPU else "cpu"
    text = jax.jit(lambda x, w: (moe_xla.quantize_fp8_rows(x), moe_xla.quantize_fp8_blocks(w),
                                 quantize_fp8_weight_layouts(w))).lower(
        jnp.zeros((4, 256)), jnp.zeros((2, 128, 128))).as_text()
    assert f"moe_xla_quantize_fp8_rows_{platform}_v1" in text
    assert f"moe_xla_quantize_fp8_blocks_{platform}_v1" in text
    assert f"moe_xla_quantize_fp8_weights_{platform}_v1" in text


@pytest.mark.parametrize("call, message", [
    (lambda: moe_xla.quantize_fp8_rows(jnp.zeros((4, 8), jnp.int32)), "expected x of dtype"),
    (lambda: moe_xla.quantize_fp8_rows(jnp.zeros((8,))), "expected x of rank >= 2"),
    (lambda: moe_xla.quantize_fp8_rows(jnp.zeros((4, 8)), pow2_scale=1), "expected pow2_scale to be a Python bool"),
    (lambda: moe_xla.quantize_fp8_rows(jnp.zeros((4, 8), jnp.float8_e4m3fn)), "got float8_e4m3fn"),
    (lambda: moe_xla.quantize_fp8_blocks(jnp.zeros((4, 8), jnp.float64 if jax.config.x64_enabled else jnp.int8)),
     "expected w of dtype"),
    (lambda: moe_xla.quantize_fp8_blocks(jnp.zeros((8,))), "expected w of rank >= 2"),
    (lambda: moe_xla.quantize_fp8_blocks(jnp.zeros((2, 8, 8)), pow2_scale="yes"), "pow2_scale"),
    (lambda: quantize_fp8_weight_layouts(jnp.zeros((2, 8, 8), jnp.int32)),
     r"quantize_fp8_weight_layouts: expected w of dtype float32, bfloat16, float16, got int32"),
    (lambda: quantize_fp8_weight_layouts(jnp.zeros((2, 8, 8), jnp.float8_e4m3fn)), "got float8_e4m3fn"),
    (lambda: quantize_fp8_weight_layouts(jnp.zeros((8,))),
     r"quantize_fp8_weight_layouts: expected w of rank >= 2 \[..., K, N\], got shape \(8,\)"),
    (lambda: quantize_fp8_weight_layouts(jnp.zeros((2, 8, 8)), pow2_scale=None),
     "quantize_fp8_weight_layouts: expected pow2_scale to be a Python bool, got None"),
    (lambda: moe_xla.quantize_fp8_weights(jnp.zeros((8, 8))),
     r"quantize_fp8_weights: expected w of rank 3 \[G, K, N\], got shape \(8, 8\)"),
    (lambda: moe_xla.quantize_fp8_weights(jnp.zeros((2, 8, 8), jnp.int8)), "expected w of dtype"),
])
def test_bad_inputs_raise_at_trace_time(call, message):
    with pytest.raises((TypeError, ValueError), match=message):
        jax.eval_shape(call)


F8, F32 = jnp.float8_e4m3fn, jnp.float32


@pytest.mark.parametrize("op, x_shape, results, message", [
    ("quantize_fp8_rows", (4, 300), [((4, 300), F8), ((4, 2), F32)], r"scales: expected shape \[4, 3\], got \[4, 2\]"),
    ("quantize_fp8_rows", (4, 300), [((4, 300), jnp.int8), ((4, 3), F32)], "q: expected dtype float8_e4m3fn"),
    ("quantize_fp8_blocks", (2, 130, 4), [((2, 130, 5), F8), ((2, 2, 1), F32)],
     r"q: expected the shape of w \[2, 130, 4\]"),
    ("quantize_fp8_blocks", (130, 4), [((130, 4), F8), ((2, 1), F32)], r"w: expected rank 3 \[G, K, N\]"),
    # quantize_fp8_weights: q, q_t, scales.
    ("quantize_fp8_weights", (2, 130, 4), [((2, 130, 4), F8), ((2, 130, 4), F8), ((2, 2, 1), F32)],
     r"q_t: expected shape \[2, 4, 130\], got \[2, 130, 4\]"),
    ("quantize_fp8_weights", (2, 130, 4), [((2, 130, 4), F8), ((2, 4, 130), jnp.int8), ((2, 2, 1), F32)],
     "q_t: expected dtype float8_e4m3fn"),
    ("quantize_fp8_weights", (2, 130, 4), [((2, 130, 4), jnp.uint8), ((2, 4, 130), F8), ((2, 2, 1), F32)],
     "q: expected dtype float8_e4m3fn"),
    ("quantize_fp8_weights", (2, 130, 4), [((2, 130, 4), F8), ((2, 4, 130), F8), ((2, 1, 1), F32)],
     r"scales: expected shape \[2, 2, 1\], got \[2, 1, 1\]"),
    ("quantize_fp8_weights", (2, 130, 4, 1), [((2, 130, 4, 1), F8), ((2, 4, 130, 1), F8), ((2, 2, 1), F32)],
     r"w: expected rank 3 \[G, K, N\], got shape \[2, 130, 4, 1\]"),
])
def test_handlers_reject_inconsistent_buffers(op, x_shape, results, message):
    """The FFI handlers check what the primitives' shape rules already guarantee, for
    callers that reach the targets without them."""
    from moe_xla import _lib

    results = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in results]
    call = jax.ffi.ffi_call(_lib.require_kernel(op, "cpu"), results)
    with jax.default_device(_device("cpu")), pytest.raises(Exception, match=message):
        jax.block_until_ready(jax.jit(lambda x: call(x, pow2_scale=False))(jnp.zeros(x_shape)))


@pytest.mark.parametrize("fn", [moe_xla.quantize_fp8_rows, moe_xla.quantize_fp8_blocks, quantize_fp8_weight_layouts])
def test_not_differentiable_but_stop_gradient_works(fn):
    x = jnp.ones((2, 130, 4))
    loss = lambda v: jnp.sum(fn(v)[-1])  # noqa: E731  (the scales)
    with pytest.raises(TypeError, match="is not differentiable"):
        jax.grad(loss)(x)
    assert np.all(np.asarray(jax.grad(lambda v: loss(jax.lax.stop_gradient(v)) + jnp.sum(v))(x)) == 1.0)


@pytest.mark.parametrize("op, ref, shape", [
    (moe_xla.quantize_fp8_rows, reference.quantize_fp8_rows, (64, 300)),
    (moe_xla.quantize_fp8_blocks, reference.quantize_fp8_blocks, (4, 130, 200)),
    (quantize_fp8_weight_layouts, reference.quantize_fp8_weight_layouts, (4, 130, 200)),
])
def test_shards_along_the_leading_dim_without_gathering(rng, op, ref, shape):
    """Rows (along M) and groups (along G) are independent: each device quantises its shard."""
    if jax.device_count() < 2:
        pytest.skip("needs 2 devices")
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("d",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d"))
    x = jax.device_put(tricky(rng, shape, jnp.float32), sharding)
    f = jax.jit(op)
    hlo = f.lower(x).compile().as_text()
    assert "all-gather" not in hlo and "all-to-all" not in hlo and "collective-permute" not in hlo
    out = f(x)
    assert all(o.sharding.spec[0] == "d" for o in out)
    assert_bitwise(out, _reference_on("cpu", ref, jax.device_get(x)))
