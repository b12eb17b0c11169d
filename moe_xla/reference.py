"""Pure-jnp definitions of every moe_xla primitive: the spec and the test oracle.

These are also the lowering used when MOE_XLA_IMPL=reference. They favour clarity over
speed and memory, and import nothing from the rest of moe_xla: an error in the runtime
package cannot hide by reaching the oracle too.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def group_ends(group_sizes, m: int):
    """Exclusive end row of each group after clamping (common/grouped_gemm.h):
    size'_g = clamp(size_g, 0, m - start_g), so end_g = min(sum_{h<=g} max(size_h, 0), m)."""
    sizes = jnp.clip(group_sizes.astype(jnp.int32), 0, m)
    return jnp.minimum(jnp.cumsum(sizes, dtype=jnp.int32), m)


def row_groups(group_sizes, m: int):
    """Group index of each of the m rows; G for rows past the last group."""
    return jnp.searchsorted(group_ends(group_sizes, m), jnp.arange(m, dtype=jnp.int32), side="right")


def gmm(lhs, rhs, group_sizes, *, transpose_rhs=False, preferred_element_type=None):
    """out[rows of g] = lhs[rows of g] @ rhs[g] (rhs[g]^T if transpose_rhs); other rows 0.

    lhs [M, K], rhs [G, K, N] ([G, N, K] if transpose_rhs), group_sizes [G] -> [M, N].
    """
    out_dtype = preferred_element_type or lhs.dtype
    m = lhs.shape[0]
    groups = row_groups(group_sizes, m)
    rhs32 = rhs.astype(jnp.float32)
    if transpose_rhs:
        rhs32 = jnp.swapaxes(rhs32, 1, 2)
    lhs32 = lhs.astype(jnp.float32)

    def add_group(acc, g):
        mask = (groups == g)[:, None]
        return acc + jnp.where(mask, jnp.dot(lhs32, rhs32[g], precision="highest"), 0.0), None

    init = jnp.zeros((m, rhs32.shape[2]), jnp.float32)
    out, _ = jax.lax.scan(add_group, init, jnp.arange(rhs.shape[0]))
    return out.astype(out_dtype)


def tgmm(lhs, rhs, group_sizes, *, preferred_element_type=None):
    """out[g] = lhs[rows of g]^T @ rhs[rows of g]; zero for empty groups.

    lhs [M, K], rhs [M, N], group_sizes [G] -> [G, K, N].
    """
    out_dtype = preferred_element_type or lhs.dtype
    m = lhs.shape[0]
    groups = row_groups(group_sizes, m)
    lhs32, rhs32 = lhs.astype(jnp.float32), rhs.astype(jnp.float32)

    def one_group(g):
        mine = (groups == g)[:, None]
        return jnp.dot(jnp.where(mine, lhs32, 0.0).T, jnp.where(mine, rhs32, 0.0), precision="highest")

    return jax.lax.map(one_group, jnp.arange(group_sizes.shape[0])).astype(out_dtype)


def route_source(logits, score: str):
    """The per-expert values weights are taken from: softmax(logits) or sigmoid(logits)."""
    x = logits.astype(jnp.float32)
    return jax.nn.softmax(x, axis=-1) if score == "softmax" else jax.nn.sigmoid(x)


def route_weights(logits, expert_ids, *, score, renormalize, scale):
    """weights[t, j] = source[t, expert_ids[t, j]], renormalised over j (when the sum is
    > 0) and scaled. Differentiable in logits for fixed expert_ids."""
    w = jnp.take_along_axis(route_source(logits, score), expert_ids, axis=-1)
    if renormalize:
        total = jnp.sum(w, axis=-1, keepdims=True)
        w = jnp.where(total > 0, w / jnp.where(total > 0, total, 1.0), w)
    return w * jnp.float32(scale)


def route(logits, *, top_k, score="softmax", bias=None, n_groups=1, topk_groups=1, renormalize=True, scale=1.0):
    """Top-k expert selection (common/routing.h): logits [T, E] -> (weights [T, k] f32,
    expert_ids [T, k] int32), ids in descending selection score, ties to the lower index."""
    source = route_source(logits, score)
    select = source if score == "softmax" or bias is None else source + bias.astype(jnp.float32)
    select = jnp.where(jnp.isnan(select), -jnp.inf, select)
    t, e = select.shape
    if n_groups > 1:
        per_group = select.reshape(t, n_groups, e // n_groups)
        group_score = jnp.sum(jax.lax.top_k(per_group, min(2, e // n_groups))[0], axis=-1)
        group_score = jnp.where(jnp.isnan(group_score), -jnp.inf, group_score)
        kept = jax.lax.top_k(group_score, topk_groups)[1]
        keep = jnp.zeros((t, n_groups), bool).at[jnp.arange(t)[:, None], kept].set(True)
        select = jnp.where(jnp.repeat(keep, e // n_groups, axis=1), select, -jnp.inf)
    expert_ids = jax.lax.top_k(select, top_k)[1].astype(jnp.int32)
    weights = route_weights(logits, expert_ids, score=score, renormalize=renormalize, scale=scale)
    return weights, expert_ids


def permute(x, expert_ids, num_experts: int):
    """Stable counting sort of the T*k assignments by expert (common/routing.h):
    -> (x_sorted [T*k, H], group_sizes [E] int32, row_map [T*k] int32)."""
    t, k = expert_ids.shape
    flat = expert_ids.reshape(-1)
    valid = (flat >= 0) & (flat < num_experts)
    key = jnp.where(valid, flat, num_experts)
    order = jnp.argsort(key, stable=True).astype(jnp.int32)  # slot -> assignment
    row_map = jnp.zeros((t * k,), jnp.int32).at[order].set(jnp.arange(t * k, dtype=jnp.int32))
    group_sizes = jnp.sum(key[:, None] == jnp.arange(num_experts)[None, :], axis=0, dtype=jnp.int32)
    x_sorted = x[order // k] if t * k else jnp.zeros((0, x.shape[1]), x.dtype)
    return x_sorted, group_sizes, row_map


def unpermute(y_sorted, row_map, weights):
    """y[t] = sum_j weights[t, j] * y_sorted[row_map[t*k + j]], in float32; row_map entries
    outside [0, T*k) contribute 0, whatever their weight or the row they would clip to."""
    t, k = weights.shape
    n = y_sorted.shape[0]
    slots = row_map.reshape(t, k)
    named = ((slots >= 0) & (slots < n))[..., None]
    rows = y_sorted.astype(jnp.float32)[jnp.clip(slots, 0, max(n - 1, 0))]  # [T, k, H]
    w = jnp.where(named, weights[..., None], 0.0)
    return jnp.sum(w * jnp.where(named, rows, 0.0), axis=1).astype(y_sorted.dtype)


def silu(x):
    """x * sigmoid(x), with sigmoid(x) = exp(x - log(1 + e^x)): no overflow, no cancellation."""
    return x * jnp.exp(x - jnp.logaddexp(0.0, x))


def gelu_tanh(x):
    """gelu in its tanh approximation (jax.nn.gelu's default)."""
    return 0.5 * x * (1.0 + jnp.tanh(jnp.sqrt(2.0 / jnp.pi) * (x + 0.044715 * x ** 3)))


GATED = {"swiglu": silu, "geglu": gelu_tanh}
PLAIN = {"gelu": gelu_tanh, "silu": silu, "relu": lambda x: jnp.maximum(x, 0.0)}


def expert_activation(h, name: str):
    """The expert activation in float32 on h [rows, 2F] (gated: gate = h[:, :F],
    up = h[:, F:], act(gate) * up) or [rows, F]."""
    if name in GATED:
        f = h.shape[-1] // 2
        return GATED[name](h[..., :f]) * h[..., f:]
    return PLAIN[name](h)


def moe(x, router_logits, w_in, w_out, *, top_k, activation="swiglu", score="softmax", bias=None, n_groups=None,
        topk_groups=None, renormalize=True, scale=1.0, shared_experts=None):
    """The MoE layer as a loop over experts (no dispatch): every expert runs on every token
    and its output is weighted by the routing weight (0 where the token did not pick it)."""
    hidden, experts = x.shape[-1], w_in.shape[0]
    x2 = x.reshape(-1, hidden).astype(jnp.float32)
    weights, ids = route(router_logits.reshape(-1, experts), top_k=top_k, score=score, bias=bias,
                         n_groups=n_groups or 1, topk_groups=topk_groups or 1, renormalize=renormalize, scale=scale)
    y = jnp.zeros_like(x2)
    for e in range(experts):
        h = jnp.dot(x2, w_in[e].astype(jnp.float32), precision="highest")
        y_e = jnp.dot(expert_activation(h, activation), w_out[e].astype(jnp.float32), precision="highest")
        coef = jnp.sum(jnp.where(ids == e, weights, 0.0), axis=-1)
        y = y + coef[:, None] * y_e
    if shared_experts is not None:
        s_in, s_out = (w.astype(jnp.float32) for w in shared_experts)
        a = expert_activation(jnp.dot(x2, s_in, precision="highest"), activation)
        y = y + jnp.dot(a, s_out, precision="highest")
    return y.reshape(x.shape).astype(x.dtype)


# --- FP8 blockwise quantisation (common/fp8_blockwise.h) -------------------------------
#
# The tilings the FP8 grouped GEMMs' forward, dgrad and wgrad need, and no more:
#   quantize_fp8_rows        1 x 128 tiles along the last dim of [M, K]: the forward's x
#                            (along K) and the dgrad's dy (along N).
#   quantize_fp8_blocks      128 x 128 blocks of w [G, K, N]: the forward's weights; the
#                            dgrad multiplies by the same blocks transposed (q and scales
#                            swapped along their last two axes), so weights are quantised once.
#   quantize_fp8_group_cols  128 x 1 tiles along M of [M, K] that restart at every group
#                            boundary: x and dy of an FP8 wgrad (the contraction is M,
#                            per group). Needed only if the wgrad is FP8 (item 3).

FP8_TILE = 128
FP8_MAX = 448.0


def _f32_bits(x):
    return jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)


def _bits_f32(b):
    return jax.lax.bitcast_convert_type(b, jnp.float32)


def _divide(a, b):
    """fl(a / b) element by element, one IEEE division each. XLA rewrites a division by a
    constant or a broadcast into a multiplication by the rounded reciprocal, which rounds
    twice; the divisor, broadcast in full behind a barrier, is neither."""
    a, b = jnp.broadcast_arrays(a, b)
    return a / jax.lax.optimization_barrier(b)


def fp8_magnitude(x):
    """m(x) = |x| for a finite normal float32 x, else 0: NaN, +-inf and float32 subnormals
    do not count in a tile's amax."""
    a = _f32_bits(x) & jnp.uint32(0x7FFFFFFF)
    return jnp.where((a >= 0x00800000) & (a < 0x7F800000), _bits_f32(a), 0.0)


def fp8_scale(amax, pow2: bool):
    """A tile's scale from its amax: 1 if amax == 0, else max(fl(amax / 448), 2^-126),
    rounded up to a power of two when pow2. (Where XLA flushes a subnormal quotient to 0
    the max gives 2^-126 too.)"""
    s = jnp.maximum(_f32_bits(_divide(amax, jnp.float32(FP8_MAX))), jnp.uint32(0x00800000))
    if pow2:
        s = jnp.where((s & 0x007FFFFF) != 0, (s & jnp.uint32(0x7F800000)) + jnp.uint32(0x00800000), s)
    return jnp.where(amax == 0, jnp.float32(1.0), _bits_f32(s))


def fp8_quantize(x, scale):
    """q = e4m3(fl(x' / scale)), rounded to nearest even and saturated to +-448 (+-inf too);
    x' is x with float32 subnormals replaced by a zero of their sign; every NaN gives the one
    NaN code 0x7f (a NaN's sign is not kept by every platform). One float32 division, as
    the kernels."""
    x = x.astype(jnp.float32)
    b = _f32_bits(x)
    x = jnp.where((b & 0x7FFFFFFF) < 0x00800000, _bits_f32(b & jnp.uint32(0x80000000)), x)
    v = jnp.clip(_divide(x, scale), -FP8_MAX, FP8_MAX)
    nan = jax.lax.bitcast_convert_type(jnp.uint8(0x7F), jnp.float8_e4m3fn)
    return jnp.where(jnp.isnan(x), nan, v.astype(jnp.float8_e4m3fn))


def _fp8_tiles(n: int) -> int:
    return -(-n // FP8_TILE)


def quantize_fp8_rows(x, *, pow2_scale=False):
    """x [M, K] -> (q [M, K] float8_e4m3fn, scales [M, ceil(K/128)] float32): one scale per
    row per 128 columns (the tail, K mod 128 columns, is a tile of its own);
    x[m, k] ~ q[m, k] * scales[m, k // 128]."""
    m, k = x.shape
    kt = _fp8_tiles(k)
    xp = jnp.pad(x.astype(jnp.float32), ((0, 0), (0, kt * FP8_TILE - k))).reshape(m, kt, FP8_TILE)
    scales = fp8_scale(jnp.max(fp8_magnitude(xp), axis=-1, initial=0.0), pow2_scale)
    q = fp8_quantize(xp, scales[..., None]).reshape(m, kt * FP8_TILE)[:, :k]
    return q, scales


def quantize_fp8_blocks(w, *, pow2_scale=False):
    """w [G, K, N] -> (q [G, K, N] float8_e4m3fn, scales [G, ceil(K/128), ceil(N/128)]
    float32): one scale per 128 x 128 block (partial blocks at the K and N tails);
    w[g, k, n] ~ q[g, k, n] * scales[g, k // 128, n // 128]."""
    g, k, n = w.shape
    kt, nt = _fp8_tiles(k), _fp8_tiles(n)
    wp = jnp.pad(w.astype(jnp.float32), ((0, 0), (0, kt * FP8_TILE - k), (0, nt * FP8_TILE - n)))
    wp = wp.reshape(g, kt, FP8_TILE, nt, FP8_TILE)
    scales = fp8_scale(jnp.max(fp8_magnitude(wp), axis=(2, 4), initial=0.0), pow2_scale)
    q = fp8_quantize(wp, scales[:, :, None, :, None]).reshape(g, kt * FP8_TILE, nt * FP8_TILE)
    return q[:, :k, :n], scales


def activate_quantize_fp8(h, *, activation: str, pow2_scale=False):
    """h [M, 2F] (gated) or [M, F] -> (a [M, F] in h's dtype, q, scales): a = the expert
    activation of h in float32 rounded to h's dtype, (q, scales) = quantize_fp8_rows(a).
    The kernels' exp / tanh are their platform's, so their a may differ from this one by
    a few ulps before rounding; their q and scales are bitwise quantize_fp8_rows of their a."""
    a = expert_activation(h.astype(jnp.float32), activation).astype(h.dtype)
    return (a, *quantize_fp8_rows(a, pow2_scale=pow2_scale))


def activate_grad_quantize_fp8(h, da, *, activation: str, pow2_scale=False):
    """h [M, 2F] (gated) or [M, F], da [M, F] -> (dh [M, C] in h's dtype, q, scales): dh =
    d/dh of sum(expert_activation(h) * da) in float32 (jax.vjp), rounded to h's dtype,
    (q, scales) = quantize_fp8_rows(dh). The kernels state the derivative as formulas
    (common/expert_activation.h) with their platform's exp / tanh, so their dh may differ
    from this one by a few ulps before rounding; their q and scales are bitwise
    quantize_fp8_rows of their dh. relu's derivative is jax.nn.relu's rule: da where h > 0,
    else 0 (at h = 0 too, where the vjp of a maximum would split da in halves)."""
    h32, da32 = h.astype(jnp.float32), da.astype(jnp.float32)
    if activation == "relu":
        dh = jnp.where(h32 > 0, da32, 0.0)
    else:
        _, vjp = jax.vjp(lambda v: expert_activation(v, activation), h32)
        dh = vjp(da32)[0]
    dh = dh.astype(h.dtype)
    return (dh, *quantize_fp8_rows(dh, pow2_scale=pow2_scale))


def fp8_group_col_tiles(group_sizes, m: int):
    """The wgrad tile of each of the m rows: rows split into the groups (clamped as
    common/grouped_gemm.h) and the rows past the last group, each segment cut into tiles of
    128 rows from its first row; tiles numbered in row order. -> [M] int32, all below
    ceil(M/128) + G (sum over the G + 1 segments of ceil(len / 128))."""
    ends = group_ends(group_sizes, m)
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends])
    lengths = jnp.concatenate([ends, jnp.full((1,), m, jnp.int32)]) - starts
    first_tile = jnp.cumsum(-(-lengths // FP8_TILE)) - -(-lengths // FP8_TILE)
    seg = row_groups(group_sizes, m)
    return (first_tile[seg] + (jnp.arange(m, dtype=jnp.int32) - starts[seg]) // FP8_TILE).astype(jnp.int32)


def quantize_fp8_group_cols(x, group_sizes, *, pow2_scale=False):
    """x [M, K], group_sizes [G] -> (q [M, K] float8_e4m3fn, scales [ceil(M/128) + G, K]
    float32): one scale per column per 128-row tile of fp8_group_col_tiles (tiles restart
    at every group boundary); x[r, k] ~ q[r, k] * scales[tile(r), k]. Scale rows of no tile
    are 1."""
    m, k = x.shape
    tile = fp8_group_col_tiles(group_sizes, m)
    rows = _fp8_tiles(m) + group_sizes.shape[0]
    amax = jnp.zeros((rows, k), jnp.float32).at[tile].max(fp8_magnitude(x))
    scales = fp8_scale(amax, pow2_scale)
    return fp8_quantize(x, scales[tile]), scales


def dequantize_fp8_rows(q, scales, dtype=jnp.float32):
    """q [M, K] * scales [M, ceil(K/128)] repeated over each tile's columns, in float32."""
    s = jnp.repeat(scales, FP8_TILE, axis=-1)[:, :q.shape[1]]
    return (q.astype(jnp.float32) * s).astype(dtype)


def dequantize_fp8_blocks(q, scales, dtype=jnp.float32):
    """q [G, K, N] * scales [G, ceil(K/128), ceil(N/128)] repeated over each block, in float32."""
    s = jnp.repeat(jnp.repeat(scales, FP8_TILE, axis=1), FP8_TILE, axis=2)[:, :q.shape[1], :q.shape[2]]
    return (q.astype(jnp.float32) * s).astype(dtype)


def dequantize_fp8_group_cols(q, scales, group_sizes, dtype=jnp.float32):
    """q [M, K] * scales[tile(r)] (fp8_group_col_tiles), in float32."""
    return (q.astype(jnp.float32) * scales[fp8_group_col_tiles(group_sizes, q.shape[0])]).astype(dtype)


def gmm_fp8(lhs, lhs_scales, rhs, rhs_scales, group_sizes, *, preferred_element_type=jnp.bfloat16, path="auto"):
    """The FP8 blockwise grouped product of common/fp8_grouped_gemm.h.

    lhs [M, K] float8_e4m3fn with lhs_scales [M, ceil(K/128)] (1 x 128 row tiles); rhs
    [G, N, K] float8_e4m3fn (each expert's matrix transposed, K contiguous) with rhs_scales
    [G, ceil(K/128), ceil(N/128)] (128 x 128 blocks, rhs[g, n, k] scaled by
    rhs_scales[g, k // 128, n // 128]). For a row r of group g, with P_j the float32 sum of
    the 128-deep block j of lhs[r] * rhs[g, n]:
        out[r, n] = sum over j in order of fl(lhs_scales[r, j] * rhs_scales[g, j, n // 128]) * P_j
    in float32, then rounded to preferred_element_type; rows past the groups are 0. The
    kernels' block sums and their fma may round differently (a few float32 ulps). `path`
    (the CUDA kernel choice of the primitive) does not change the result.
    """
    del path
    m, k = lhs.shape
    num_groups, n, _ = rhs.shape
    kt = _fp8_tiles(k)
    pad = kt * FP8_TILE - k
    a = jnp.pad(lhs.astype(jnp.float32), ((0, 0), (0, pad))).reshape(m, kt, FP8_TILE)
    b = jnp.pad(rhs.astype(jnp.float32), ((0, 0), (0, 0), (0, pad))).reshape(num_groups, n, kt, FP8_TILE)
    col_scales = jnp.repeat(rhs_scales, FP8_TILE, axis=2)[:, :, :n]  # [G, Kt, N]
    groups = row_groups(group_sizes, m)

    def add_group(acc, g):
        blocks = jnp.einsum("mjk,njk->jmn", a, b[g], precision="highest")
        out = jnp.zeros((m, n), jnp.float32)
        for j in range(kt):
            out = out + (lhs_scales[:, j, None] * col_scales[g, j][None, :]) * blocks[j]
        return acc + jnp.where((groups == g)[:, None], out, 0.0), None

    out, _ = jax.lax.scan(add_group, jnp.zeros((m, n), jnp.float32), jnp.arange(num_groups))
    return out.astype(preferred_element_type)
