"""The FP8 blockwise grouped product (common/fp8_grouped_gemm.h) and the differentiable
FP8 gmm built on it (moe_xla.fp8).

Kernels: the CPU kernel bitwise against a numpy emulation of the contract's order (block
sums sequential in k, one fma per block with the rounded product of the scales); the
reference within float32 roundings of the kernels, and against the product of the
dequantised operands in float64; on the GPU, the SIMT path (K not a multiple of 16)
bitwise against the CPU and the CUTLASS path within the stated relative error. Shapes have
K and N tails, empty groups, rows past the groups, clamped and negative sizes.
Rules: vmap against a loop, sharding along N against one device, errors naming the
argument. The differentiable gmm: forward against the FP8 primitive on quantised inputs,
gradients against numpy (dgrad through the transposed weight blocks; the FP8 wgrad from
128-row column tiles of each group, or the bf16 one), and within FP8 accuracy of the
unquantised product.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from conftest import ON_GPU, normal, rel_err, requires_8_devices, requires_gpu
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import moe_xla
from moe_xla import reference
from moe_xla.primitives import gmm_fp8 as gmm_fp8_module

# (M, K, N, G): K and N tails, one group, more groups than rows, a single 128 block.
SHAPES = [(70, 300, 200, 4), (1, 128, 128, 1), (33, 16, 48, 9), (130, 257, 129, 3)]


def _sizes(kind, m, g, rng):
    if kind == "random":
        cuts = np.sort(rng.integers(0, m + 1, size=g - 1))
        return np.diff(np.concatenate([[0], cuts, [m]])).astype(np.int32)
    if kind == "empty_and_short":  # empty groups and rows past the last group
        s = np.zeros(g, np.int32)
        s[::2] = m // (2 * ((g + 1) // 2))
        return s
    if kind == "clamped":  # sizes past M and negative ones (clamped as gmm's)
        s = np.full(g, m, np.int32)
        s[0] = -5
        return s
    raise ValueError(kind)


def _operands(rng, m, k, n, g):
    x = rng.standard_normal((m, k)).astype(np.float32) * np.exp(rng.uniform(-3, 3, (m, 1))).astype(np.float32)
    w = rng.standard_normal((g, n, k)).astype(np.float32) * np.exp(rng.uniform(-3, 3, (g, 1, 1))).astype(np.float32)
    lhs, lhs_s = jax.jit(moe_xla.quantize_fp8_rows)(jnp.asarray(x))
    rhs, rhs_s = jax.jit(moe_xla.quantize_fp8_blocks)(jnp.swapaxes(jnp.asarray(w), 1, 2))
    return lhs, lhs_s, jnp.swapaxes(rhs, 1, 2), rhs_s


def _emulate(lhs, lhs_s, rhs, rhs_s, sizes, out_dtype):
    """The contract's order in numpy: block sums sequential in k (float32), then per block
    acc = fma(fl(s_l * s_r), P, acc) (the fma through long double: exact product, one
    rounding of the sum, then one to float32)."""
    a = np.asarray(lhs).astype(np.float32)
    b = np.asarray(rhs).astype(np.float32)
    ls, rs = np.asarray(lhs_s), np.asarray(rhs_s)
    m, k = a.shape
    n = b.shape[1]
    out = np.zeros((m, n), np.float32)
    start = 0
    for g, size in enumerate(sizes):
        size = int(min(max(size, 0), m - start))
        rows = slice(start, start + size)
        acc = np.zeros((size, n), np.float32)
        for j in range(-(-k // 128)):
            partial = np.zeros((size, n), np.float32)
            for i in range(128 * j, min(128 * (j + 1), k)):
                partial = partial + a[rows, i, None] * b[g, None, :, i]
            scale = ls[rows, j, None] * np.repeat(rs[g, j], 128)[None, :n]
            acc = (scale.astype(np.longdouble) * partial + acc).astype(np.float32)
        out[rows] = acc
        start += size
    return out.astype(ml_dtypes.bfloat16) if out_dtype == jnp.bfloat16 else out


def _run(device, operands, sizes, out_dtype, path="auto"):
    args = jax.device_put((*operands, jnp.asarray(sizes)), device)
    return jax.jit(moe_xla.gmm_fp8, static_argnames=("preferred_element_type", "path"))(
        *args, preferred_element_type=out_dtype, path=path)


@pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("kind", ["random", "empty_and_short", "clamped"])
@pytest.mark.parametrize("shape", SHAPES)
def test_cpu_kernel_bitwise_against_the_contract(rng, shape, kind, out_dtype):
    m, k, n, g = shape
    ops = _operands(rng, m, k, n, g)
    sizes = _sizes(kind, m, g, rng)
    out = np.asarray(_run(jax.devices("cpu")[0], ops, sizes, out_dtype))
    want = _emulate(*ops, sizes, out_dtype)
    assert out.dtype == want.dtype
    np.testing.assert_array_equal(out.view(np.uint8), want.view(np.uint8))


@pytest.mark.parametrize("shape", SHAPES)
def test_reference_against_the_kernel_and_the_dequantised_product(rng, shape):
    m, k, n, g = shape
    lhs, lhs_s, rhs, rhs_s = ops = _operands(rng, m, k, n, g)
    sizes = _sizes("empty_and_short", m, g, rng)
    ref = np.asarray(jax.jit(reference.gmm_fp8, static_argnames="preferred_element_type")(
        *ops, jnp.asarray(sizes), preferred_element_type=jnp.float32))
    kernel = np.asarray(_run(jax.devices("cpu")[0], ops, sizes, jnp.float32))
    assert rel_err(ref, kernel) < 1e-6
    x = np.asarray(reference.dequantize_fp8_rows(lhs, lhs_s), np.float64)
    w = np.asarray(reference.dequantize_fp8_blocks(jnp.swapaxes(rhs, 1, 2), rhs_s), np.float64)
    dense = np.zeros((m, n))
    start = 0
    for e, size in enumerate(sizes):
        dense[start:start + size] = x[start:start + size] @ w[e]
        start += size
    assert rel_err(ref, dense) < 1e-6
    np.testing.assert_array_equal(ref[start:], 0.0)


@requires_gpu
@pytest.mark.parametrize("kind", ["random", "empty_and_short", "clamped"])
@pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("k, path", [(200, "auto"), (256, "simt")])  # K % 16 != 0, or forced
def test_gpu_simt_path_bitwise_against_the_cpu(rng, kind, out_dtype, k, path):
    m, n, g = 70, 136, 5
    ops = _operands(rng, m, k, n, g)
    sizes = _sizes(kind, m, g, rng)
    gpu = np.asarray(_run(jax.devices("gpu")[0], ops, sizes, out_dtype, path))
    cpu = np.asarray(_run(jax.devices("cpu")[0], ops, sizes, out_dtype))
    np.testing.assert_array_equal(gpu.view(np.uint8), cpu.view(np.uint8))


# The TMA paths (CUTLASS's and our wgmma kernel): 64- and 128-row tiles (average group
# sizes below and above 128), N tails inside a 128- and a 192-column tile, K tails inside a
# 128-deep step, empty groups; the fifth shape has more 128 x 128 tiles than the H200 has
# SMs (the persistent loop) and an odd number of K steps; the sixth has groups of more than
# 16 row tiles (two bands of the wgmma kernel's unit order) and an odd number of column
# tiles; the last one K step (K 112) and a second 192-column tile whose scale block is
# rhs's last.
GPU_SHAPES = [(1000, 512, 384, 8), (4096, 1024, 256, 4), (700, 272, 136, 16), (300, 2048, 512, 2),
              (6000, 640, 1024, 6), (5000, 256, 384, 2), (520, 112, 200, 3)]


TMA_PATHS = [p for p in gmm_fp8_module.PATHS if p not in ("auto", "simt")]
# The paths instantiated for float32 output too.
F32_PATHS = ("auto", "cutlass_coop128x128_1x2", "wgmma128x128", "wgmma128x192")


@requires_gpu
@pytest.mark.parametrize("path", ["auto"] + TMA_PATHS)
@pytest.mark.parametrize("kind", ["random", "empty_and_short", "clamped"])
@pytest.mark.parametrize("shape", GPU_SHAPES)
def test_gpu_tma_path_against_the_cpu(rng, shape, kind, path):
    """Hopper's FP8 tensor cores sum a 128-deep step with about 14 significant bits before
    the kernel promotes it to the float32 accumulator (the limit DeepSeek-V3's report measured
    and its 128-deep promotion interval bounds): per element within 2^-11 of sum_j |fl(s_a
    s_b) P_j| (the product of the dequantised magnitudes). Measured: 8.5e-5 of it at most
    on an H200 where K is a multiple of 128; 3.2e-4 at K 112 (one partial step) on an H100,
    CUTLASS's kernels and ours alike (ours are bitwise CUTLASS's there)."""
    m, k, n, g = shape
    lhs, lhs_s, rhs, rhs_s = ops = _operands(rng, m, k, n, g)
    sizes = _sizes(kind, m, g, rng)
    cpu = np.asarray(_run(jax.devices("cpu")[0], ops, sizes, jnp.float32), np.float64)
    bf16 = np.asarray(_run(jax.devices("gpu")[0], ops, sizes, jnp.bfloat16, path), np.float64)
    gpu = np.asarray(_run(jax.devices("gpu")[0], ops, sizes, jnp.float32,
                          path if path in F32_PATHS else "cutlass_coop128x128_1x2"), np.float64)
    x = np.abs(np.asarray(reference.dequantize_fp8_rows(lhs, lhs_s), np.float64))
    w = np.abs(np.asarray(reference.dequantize_fp8_blocks(jnp.swapaxes(rhs, 1, 2), rhs_s), np.float64))
    bound = np.zeros((m, n))
    start = 0
    for e, size in enumerate(np.asarray(reference.group_ends(jnp.asarray(sizes), m)) - 0):
        bound[start:size] = x[start:size] @ w[e]
        start = size
    assert np.all(np.abs(gpu - cpu) <= 2.0 ** -11 * bound), np.max(np.abs(gpu - cpu) / np.maximum(bound, 1e-30))
    assert np.all(np.abs(bf16 - cpu) <= 2.0 ** -8 * np.abs(cpu) + 2.0 ** -11 * bound)


def test_vmap_equals_a_loop(rng):
    b, m, k, n, g = 3, 40, 200, 130, 3
    per = [_operands(rng, m, k, n, g) for _ in range(b)]
    stacked = [jnp.stack(xs) for xs in zip(*per)]
    sizes = jnp.asarray(np.stack([_sizes(kind, m, g, rng) for kind in ("random", "empty_and_short", "clamped")]))
    out = jax.jit(jax.vmap(moe_xla.gmm_fp8))(*stacked, sizes)
    for i in range(b):
        np.testing.assert_array_equal(np.asarray(out[i]).view(np.uint16),
                                      np.asarray(moe_xla.gmm_fp8(*per[i], sizes[i])).view(np.uint16))


@requires_8_devices
@pytest.mark.parametrize("n", [1024, 256])  # 128 columns per shard; 32 per shard (kept whole)
def test_sharded_along_n_equals_one_device(rng, n):
    m, k, g = 64, 256, 4
    lhs, lhs_s, rhs, rhs_s = _operands(rng, m, k, n, g)
    sizes = jnp.asarray(_sizes("random", m, g, rng))
    mesh = Mesh(np.array(jax.devices()[:8]), ("n",))
    put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))  # noqa: E731
    scale_spec = P(None, None, "n") if n == 1024 else P()  # 2 column blocks cannot split 8 ways
    args = (put(lhs, P()), put(lhs_s, P()), put(rhs, P(None, "n", None)), put(rhs_s, scale_spec), put(sizes, P()))
    out = jax.jit(moe_xla.gmm_fp8)(*args)
    want = moe_xla.gmm_fp8(lhs, lhs_s, rhs, rhs_s, sizes)
    np.testing.assert_array_equal(np.asarray(out).view(np.uint16), np.asarray(want).view(np.uint16))
    if n == 1024:
        hlo = jax.jit(moe_xla.gmm_fp8).lower(*args).compile().as_text()
        assert "all-gather" not in hlo, "an N split in whole 128-column blocks needs no gather"


def test_errors_name_the_argument(rng):
    lhs, lhs_s, rhs, rhs_s = _operands(rng, 8, 256, 128, 2)
    gs = jnp.asarray([4, 4], jnp.int32)
    with pytest.raises(TypeError, match="lhs of dtype float8_e4m3fn, got bfloat16"):
        moe_xla.gmm_fp8(lhs.astype(jnp.bfloat16), lhs_s, rhs, rhs_s, gs)
    with pytest.raises(ValueError, match=r"lhs_scales of shape \(8, 2\), got \(8, 1\)"):
        moe_xla.gmm_fp8(lhs, lhs_s[:, :1], rhs, rhs_s, gs)
    with pytest.raises(ValueError, match=r"rhs_scales of shape \(2, 2, 1\)"):
        moe_xla.gmm_fp8(lhs, lhs_s, rhs, jnp.swapaxes(rhs_s, 1, 2)[:, :1], gs)
    with pytest.raises(TypeError, match="float32 rhs_scales, got bfloat16"):
        moe_xla.gmm_fp8(lhs, lhs_s, rhs, rhs_s.astype(jnp.bfloat16), gs)
    with pytest.raises(ValueError, match=r"rhs.shape\[2\] \(K of lhs \[M, K\]\) = 256, got 128"):
        moe_xla.gmm_fp8(lhs, lhs_s, rhs[:, :, :128], rhs_s[:, :1], gs)
    with pytest.raises(ValueError, match=r"group_sizes of shape \(2,\)"):
        moe_xla.gmm_fp8(lhs, lhs_s, rhs, rhs_s, gs[:1])
    with pytest.raises(TypeError, match="preferred_element_type bfloat16 or float32"):
        moe_xla.gmm_fp8(lhs, lhs_s, rhs, rhs_s, gs, preferred_element_type=jnp.float16)
    with pytest.raises(ValueError, match=r"expected path in \('auto', 'simt', .*\), got 'fast'"):
        moe_xla.gmm_fp8(lhs, lhs_s, rhs, rhs_s, gs, path="fast")
    with pytest.raises(TypeError, match="gmm_fp8 is not differentiable"):
        jax.grad(lambda s: moe_xla.gmm_fp8(lhs, s, rhs, rhs_s, gs).astype(jnp.float32).sum())(lhs_s)


@requires_gpu
@pytest.mark.parametrize("path,out_dtype", [(p, d) for p in ("wgmma128x128", "wgmma128x192", "wgmma128x192_bulk")
                                            for d in (jnp.float32, jnp.bfloat16) if d == jnp.bfloat16 or p in F32_PATHS])
@pytest.mark.parametrize("kind", ["random", "empty_and_short", "clamped"])
@pytest.mark.parametrize("shape", GPU_SHAPES)
def test_gpu_wgmma_path_bitwise_against_cutlass(rng, shape, kind, out_dtype, path):
    """Our kernel computes each 128-deep block sum with wgmma k32 steps in the same order as
    CUTLASS's cooperative 128 x 128 kernel (a wider tile adds columns, not terms) and
    promotes it with the same one fma per block, with the scale of each column's block (a
    192-column tile straddles two), so the two agree bit for bit (rows past the groups
    included)."""
    m, k, n, g = shape
    ops = _operands(rng, m, k, n, g)
    sizes = _sizes(kind, m, g, rng)
    ours = np.asarray(_run(jax.devices("gpu")[0], ops, sizes, out_dtype, path))
    cutlass = np.asarray(_run(jax.devices("gpu")[0], ops, sizes, out_dtype, "cutlass_coop128x128_1x2"))
    np.testing.assert_array_equal(ours.view(np.uint8), cutlass.view(np.uint8))


@requires_gpu
@pytest.mark.parametrize("path", TMA_PATHS)
def test_gpu_forced_path_that_cannot_compute_names_itself(rng, path):
    """K % 16 != 0 rules out TMA: the error names the path by the name Python passed, which
    also checks that PATHS lists the kernels in the order of cuda::Fp8GemmPath."""
    ops = _operands(rng, 64, 200, 128, 2)
    with pytest.raises(Exception, match=f"path {path} does not support"):
        np.asarray(_run(jax.devices("gpu")[0], ops, np.asarray([32, 32], np.int32), jnp.bfloat16, path))


# --- the differentiable FP8 gmm ----------------------------------------------------------

def _dequant_rows(x):
    q, s = moe_xla.quantize_fp8_rows(x)
    return np.asarray(reference.dequantize_fp8_rows(q, s), np.float64)


def _dequant_blocks(w):
    q, s = moe_xla.quantize_fp8_blocks(w)
    return np.asarray(reference.dequantize_fp8_blocks(q, s), np.float64)


def _grouped(f, sizes, m):
    """[M, ...] of f(group, rows) per group, zero past the groups (numpy)."""
    ends = np.asarray(reference.group_ends(jnp.asarray(sizes), m))
    return [(e, slice(s, t)) for e, (s, t) in enumerate(zip(np.concatenate([[0], ends[:-1]]), ends))]


def _dequant_group_cols(a, sizes):
    """a [M, K] quantised in the wgrad's group-column tiles and dequantised, in float64."""
    q, s = moe_xla.quantize_fp8_group_cols(a, sizes)
    return np.asarray(reference.dequantize_fp8_group_cols(q, s, sizes, a.shape[0]), np.float64)


@pytest.mark.parametrize("quantization", ["fp8_blockwise", "fp8_blockwise_fp8_wgrad"])
@pytest.mark.parametrize("transpose_rhs", [False, True])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_fp8_gmm_forward_and_gradients(rng, dtype, transpose_rhs, quantization):
    m, k, n, g = 96, 256, 384, 4
    x = normal(rng, (m, k), dtype)
    w = normal(rng, (g, k, n), dtype) * 0.1
    rhs = jnp.swapaxes(w, 1, 2) if transpose_rhs else w
    dy = normal(rng, (m, n), dtype)
    sizes = jnp.asarray(_sizes("empty_and_short", m, g, rng))

    def f(x, rhs):
        return moe_xla.gmm(x, rhs, sizes, transpose_rhs=transpose_rhs, quantization=quantization)

    y, vjp = jax.vjp(jax.jit(f), x, rhs)
    dx, drhs = vjp(dy)
    assert y.dtype == dtype and dx.dtype == dtype and drhs.dtype == dtype and drhs.shape == rhs.shape
    # Forward: the FP8 primitive on the quantised operands.
    qx, sx = moe_xla.quantize_fp8_rows(x)
    wq = moe_xla.quantize_fp8_weights(w)
    want = moe_xla.gmm_fp8(qx, sx, wq.data_t, wq.scales, sizes, preferred_element_type=dtype
                           if dtype == jnp.bfloat16 else jnp.float32)
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(want, np.float32))
    # Gradients against numpy: dx = Q(dy) @ Q(w)^T per group, dw = x^T dy per group with x
    # and dy in the wgrad's column tiles (FP8 wgrad) or as they are (bf16 wgrad).
    qdy, qw, xs, dys = _dequant_rows(dy), _dequant_blocks(w), np.asarray(x, np.float64), np.asarray(dy, np.float64)
    xw, dyw = (_dequant_group_cols(x, sizes), _dequant_group_cols(dy, sizes)) if quantization == "fp8_blockwise_fp8_wgrad" \
        else (xs, dys)
    dx_want, dw_want, dw_exact = np.zeros((m, k)), np.zeros((g, k, n)), np.zeros((g, k, n))
    for e, rows in _grouped(None, sizes, m):
        dx_want[rows] = qdy[rows] @ qw[e].T
        dw_want[e] = xw[rows].T @ dyw[rows]
        dw_exact[e] = xs[rows].T @ dys[rows]
    # f32: CPU bitwise up to numpy's order; the GPU's tensor cores sum 128-deep FP8 steps
    # with ~14 bits (H200: 1.3e-4).
    tol = 1e-2 if dtype == jnp.bfloat16 else 5e-4 if ON_GPU else 1e-6
    assert rel_err(dx, dx_want) < tol
    dw = jnp.swapaxes(drhs, 1, 2) if transpose_rhs else drhs
    assert rel_err(dw, dw_want) < tol
    assert rel_err(dw, dw_exact) < 0.06  # FP8 accuracy of the wgrad
    # FP8 accuracy against the unquantised product.
    exact = np.zeros((m, n))
    for e, rows in _grouped(None, sizes, m):
        exact[rows] = xs[rows] @ np.asarray(w[e], np.float64)
    assert rel_err(y, exact) < 0.06


def test_prequantised_weights_get_no_gradient_and_need_the_option(rng):
    m, k, n, g = 64, 128, 256, 2
    x, w = normal(rng, (m, k), jnp.bfloat16), normal(rng, (g, k, n), jnp.bfloat16)
    sizes = jnp.asarray([30, 34], jnp.int32)
    wq = moe_xla.quantize_fp8_weights(w)
    f = lambda x: moe_xla.gmm(x, wq, sizes, quantization="fp8_blockwise").astype(jnp.float32).sum()  # noqa: E731
    g_pre = jax.jit(jax.grad(f))(x)
    g_arr = jax.grad(lambda x: moe_xla.gmm(x, w, sizes, quantization="fp8_blockwise").astype(jnp.float32).sum())(x)
    np.testing.assert_array_equal(np.asarray(g_pre, np.float32), np.asarray(g_arr, np.float32))
    with pytest.raises(TypeError, match=r"pass an FP8 quantization \('fp8_blockwise'\)"):
        moe_xla.gmm(x, wq, sizes)
    with pytest.raises(ValueError, match="transpose_rhs must be False for Fp8Weights"):
        moe_xla.gmm(x, wq, sizes, transpose_rhs=True, quantization="fp8_blockwise")
    with pytest.raises(ValueError, match=r"expected quantization in \(None, 'fp8_blockwise', "
                                         r"'fp8_blockwise_fp8_wgrad'\), got 'fp8'"):
        moe_xla.gmm(x, w, sizes, quantization="fp8")


@pytest.mark.parametrize("transpose_rhs", [False, True])
def test_quantized_rhs_is_used_and_rhs_gets_the_gradient(rng, transpose_rhs):
    m, k, n, g = 64, 128, 256, 2
    x, w = normal(rng, (m, k), jnp.bfloat16), normal(rng, (g, k, n), jnp.bfloat16)
    rhs = jnp.swapaxes(w, 1, 2) if transpose_rhs else w
    sizes = jnp.asarray([30, 34], jnp.int32)

    def f(x, rhs, wq):
        out = moe_xla.gmm(x, rhs, sizes, transpose_rhs=transpose_rhs, quantization="fp8_blockwise", quantized_rhs=wq)
        return out.astype(jnp.float32).sum()

    inside = jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(x, rhs, None)
    outside = jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(x, rhs, moe_xla.quantize_fp8_weights(w))
    for a, b in zip(jax.tree.leaves(inside), jax.tree.leaves(outside)):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    with pytest.raises(TypeError, match=r"quantized_rhs needs an FP8 quantization \('fp8_blockwise'\)"):
        moe_xla.gmm(x, rhs, sizes, transpose_rhs=transpose_rhs, quantized_rhs=moe_xla.quantize_fp8_weights(w))
    with pytest.raises(ValueError, match=r"expected rhs_quantized of the weights' shape \(2, 128, 256\)"):
        moe_xla.gmm(x, rhs, sizes, transpose_rhs=transpose_rhs, quantization="fp8_blockwise",
                    quantized_rhs=moe_xla.quantize_fp8_weights(w[:, :, :128]))
    with pytest.raises(TypeError, match="expected rhs_quantized to be an Fp8Weights"):
        moe_xla.gmm(x, rhs, sizes, transpose_rhs=transpose_rhs, quantization="fp8_blockwise", quantized_rhs=w)


def test_fp8_gmm_under_vmap_checkpoint_and_scan(rng):
    b, m, k, n, g = 2, 64, 128, 128, 2
    x, w = normal(rng, (b, m, k), jnp.bfloat16), normal(rng, (b, g, k, n), jnp.bfloat16)
    sizes = jnp.asarray([[20, 44], [64, 0]], jnp.int32)

    def loss(x, w, s):
        return moe_xla.gmm(x, w, s, quantization="fp8_blockwise").astype(jnp.float32).sum()

    g_vmap = jax.jit(jax.vmap(jax.grad(jax.checkpoint(loss), argnums=(0, 1))))(x, w, sizes)

    def body(carry, xs):
        return carry, jax.grad(loss, argnums=(0, 1))(*xs)

    _, g_scan = jax.lax.scan(body, 0, (x, w, sizes))
    for a, c in zip(g_vmap, g_scan):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(c, np.float32))
