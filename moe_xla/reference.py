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


def gather_rows(values, src, factor=None):
    """values [T, H], src [R] int32, factor [R] float32 or None -> rows [R, H] in values'
    dtype: rows[r] = values[src[r]] (bitwise), or fp8_scaled_element(factor[r],
    values[src[r]]) rounded once to values' dtype; a zero row where src[r] is outside [0, T)."""
    t, h = values.shape
    named = ((src >= 0) & (src < t))[:, None]
    if not t:
        return jnp.zeros((src.shape[0], h), values.dtype)
    rows = values[jnp.clip(src, 0, t - 1)]
    if factor is not None:
        rows = fp8_scaled_element(factor[:, None], rows.astype(jnp.float32)).astype(values.dtype)
    return jnp.where(named, rows, jnp.zeros((), values.dtype))


def gather_gmm(x, src, w, group_sizes, *, transpose_rhs=False, preferred_element_type=None):
    """out[rows of g] = x[src[rows of g]] @ w[g] (w[g]^T if transpose_rhs): gmm of the
    gathered rows, where src outside [0, T) gathers a zero row. x [T, K], src [M],
    w [G, K, N] ([G, N, K] if transpose_rhs), group_sizes [G] -> [M, N]."""
    return gmm(gather_rows(x, src), w, group_sizes, transpose_rhs=transpose_rhs,
               preferred_element_type=preferred_element_type or x.dtype)


def gather_tgmm(x, src, dy, group_sizes, *, transpose_out=False, preferred_element_type=None):
    """out[g] = sum_{r in rows of g} x_r (outer) dy[r] with x_r = x[src[r]], a zero row where
    src[r] is outside [0, T): tgmm of the gathered rows (gather_gmm's gradient in w).
    x [T, K], src [M], dy [M, N], group_sizes [G] -> [G, K, N]; with transpose_out each
    block's transpose, sum_r dy[r] (outer) x_r -> [G, N, K]."""
    out = tgmm(gather_rows(x, src), dy, group_sizes, preferred_element_type=preferred_element_type or x.dtype)
    return jnp.swapaxes(out, 1, 2) if transpose_out else out


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


def route_grad(logits, expert_ids, d_weights, *, score, renormalize, scale):
    """d logits [T, E] (logits' dtype): the vector-Jacobian product of route_weights in
    logits for fixed expert_ids with cotangent d_weights [T, k], in the closed form of
    common/routing.h (w / S formed first: no S * S); ids outside [0, E) pick nothing (w_j
    = 0) and receive nothing."""
    e = logits.shape[-1]
    valid = (expert_ids >= 0) & (expert_ids < e)
    p = route_source(logits, score)
    w = jnp.where(valid, jnp.take_along_axis(p, jnp.where(valid, expert_ids, 0), axis=-1), 0.0)
    g = d_weights.astype(jnp.float32) * jnp.float32(scale)
    b = w * g
    if renormalize:
        total = jnp.sum(w, axis=-1, keepdims=True)
        v = w / jnp.where(total > 0, total, 1.0)
        b = jnp.where(total > 0, v * (g - jnp.sum(v * g, axis=-1, keepdims=True)), b)
    a = b if score == "softmax" else (1.0 - w) * b
    rows = jnp.arange(logits.shape[0])[:, None]
    d = jnp.zeros(logits.shape, jnp.float32).at[rows, jnp.where(valid, expert_ids, e)].add(a, mode="drop")
    if score == "softmax":
        d = d - p * jnp.sum(a, axis=-1, keepdims=True)
    return d.astype(logits.dtype)


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


def permute(x, expert_ids, num_experts: int, *, return_row_pairs=False):
    """Stable counting sort of the T*k assignments by expert (common/routing.h):
    -> (x_sorted [T*k, H], group_sizes [E] int32, row_map [T*k] int32), and with
    return_row_pairs row_pairs [T*k] int32, the sort's order (the assignment of each sorted
    row, row_map's inverse)."""
    t, k = expert_ids.shape
    flat = expert_ids.reshape(-1)
    valid = (flat >= 0) & (flat < num_experts)
    key = jnp.where(valid, flat, num_experts)
    order = jnp.argsort(key, stable=True).astype(jnp.int32)  # slot -> assignment
    row_map = jnp.zeros((t * k,), jnp.int32).at[order].set(jnp.arange(t * k, dtype=jnp.int32))
    group_sizes = jnp.sum(key[:, None] == jnp.arange(num_experts)[None, :], axis=0, dtype=jnp.int32)
    x_sorted = x[order // k] if t * k else jnp.zeros((0, x.shape[1]), x.dtype)
    return (x_sorted, group_sizes, row_map, order) if return_row_pairs else (x_sorted, group_sizes, row_map)


def unpermute(y_sorted, row_map, weights):
    """y[t] = sum_j weights[t, j] * y_sorted[row_map[t*k + j]], in float32; y_sorted [R, H]
    (R = T*k after permute, any R otherwise); row_map entries outside [0, R) contribute 0,
    whatever their weight or the row they would clip to."""
    t, k = weights.shape
    n = y_sorted.shape[0]
    if n == 0:
        return jnp.zeros((t, y_sorted.shape[1]), y_sorted.dtype)
    slots = row_map.reshape(t, k)
    named = ((slots >= 0) & (slots < n))[..., None]
    rows = y_sorted.astype(jnp.float32)[jnp.clip(slots, 0, n - 1)]  # [T, k, H]
    w = jnp.where(named, weights[..., None], 0.0)
    return jnp.sum(w * jnp.where(named, rows, 0.0), axis=1).astype(y_sorted.dtype)


def ep_dedup_rows(dest, lid, *, peers: int, local: int, mult: int):
    """The EP layer's rows with dedup (common/ep_plan.h): token t sends one row per valid
    destination d in [0, peers), at its first j with dest[t, j] = d, asking for the slots
    lid of its pairs there in j order.
    -> (row_dest [T, k]: d at that first j, peers elsewhere; lids [T*n, mult]: row c of t
    (its c-th first j) asks for lid[t, j] of its m-th pair at lids[t*n + c, m], `local`
    past them; weight_slot [T*k]: (t*n + c)*mult + m for that pair, -1 for an invalid
    destination or m >= mult; weight_sources [T*n*mult]: its inverse, t*k + j at that
    place, -1 where none), n = min(k, peers)."""
    t, k = dest.shape
    n = min(k, peers)
    valid = (dest >= 0) & (dest < peers)
    same = (dest[:, :, None] == dest[:, None, :]) & valid[:, :, None]    # [T, k, k]: j, j' go to one valid rank
    before = jnp.arange(k)[None, :] < jnp.arange(k)[:, None]              # [k, k]: j' < j
    m = jnp.sum(same & before, axis=-1, dtype=jnp.int32)                  # pairs of j's rank before j
    first = valid & (m == 0)
    row_of_first = jnp.cumsum(first, axis=-1, dtype=jnp.int32) - 1
    c = jnp.take_along_axis(row_of_first, jnp.argmax(same, axis=-1), axis=-1)  # j's row: its rank's first j's
    kept = valid & (m < mult)
    tokens = jnp.arange(t, dtype=jnp.int32)[:, None]
    slot = (tokens * n + c) * mult + m
    at = jnp.where(kept, slot, t * n * mult)
    lids = jnp.full((t * n * mult,), local, jnp.int32).at[at].set(lid, mode="drop")
    sources = jnp.full((t * n * mult,), -1, jnp.int32).at[at].set(
        jnp.arange(t * k, dtype=jnp.int32).reshape(t, k), mode="drop")
    return (jnp.where(first, dest, peers), lids.reshape(t * n, mult), jnp.where(kept, slot, -1).reshape(-1), sources)


def ep_row_places(row_dest, row_map, lids, *, peers: int, local: int, rows_per_token: int):
    """Where the EP layer's rows sit among the rows grouped by destination (common/ep_plan.h).
    Row c < n = rows_per_token of token t is its c-th j with a valid row_dest[t, j]; row_map
    is permute's of row_dest over `peers`; lids [T*n, M] the rows' slots.
    -> (dest_rows [T, n]: row_dest of row c, peers where t has fewer rows; row [T, n]: its
    row_map entry r, T*k there and where r is outside [0, T*k); source [T*k]: t*n + c at
    row r = row[t, c] in [0, T*k), T*n elsewhere; pairs [T*k]: the row's lids in
    [0, local) there, 0 elsewhere)."""
    t, k = row_dest.shape
    n = rows_per_token
    valid = (row_dest >= 0) & (row_dest < peers)
    c = jnp.cumsum(valid, axis=-1, dtype=jnp.int32) - 1
    is_row = valid & (c < n)
    tokens = jnp.arange(t, dtype=jnp.int32)[:, None]
    at = (tokens, jnp.where(is_row, c, n))
    r = row_map.reshape(t, k)
    named = is_row & (r >= 0) & (r < t * k)
    place = jnp.where(named, r, t * k)
    dest_rows = jnp.full((t, n), peers, jnp.int32).at[at].set(row_dest, mode="drop")
    row = jnp.full((t, n), t * k, jnp.int32).at[at].set(place, mode="drop")
    asks = jnp.sum((lids >= 0) & (lids < local), axis=-1, dtype=jnp.int32).reshape(t, n)
    source = jnp.full((t * k,), t * n, jnp.int32).at[place].set(tokens * n + c, mode="drop")
    pairs = jnp.zeros((t * k,), jnp.int32).at[place].set(
        jnp.take_along_axis(asks, jnp.clip(c, 0, max(n - 1, 0)), axis=-1) if n else 0, mode="drop")
    return dest_rows, row, source, pairs


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


def gather_gmm_activate(x, src, w_in, group_sizes, *, activation: str):
    """act(x[src[rows of g]] @ w_in[g]): the expert activation (expert_activation) of the
    float32 gather_gmm, rounded once to x.dtype. x [T, K], src [M], w_in [G, K, N],
    group_sizes [G] -> [M, N / 2] (gated) or [M, N]."""
    h = gather_gmm(x, src, w_in, group_sizes, preferred_element_type=jnp.float32)
    return expert_activation(h, activation).astype(x.dtype)


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
#   quantize_fp8_weight_layouts  the same blocks with q in both layouts, q [G, K, N] and
#                            q_t [G, N, K] (the kernels write both in one pass).
#   quantize_fp8_group_cols  128 x 1 tiles along M of [M, K] that restart at every group
#                            boundary, written transposed: x and dy of the FP8 wgrad
#                            tgmm_fp8 (the contraction is M, per group).
#   quantize_fp8_rows_group_cols  quantize_fp8_rows and quantize_fp8_group_cols of one x
#                            (the kernels read x once for both).
#   gather_quantize_fp8_group_cols  both tilings of rows gathered from token rows, the
#                            column tiles of the rows scaled (the permuted copy never stored).
#   activate_quantize_fp8_group_cols  both tilings of the expert activation a of h (a
#                            never stored): the FP8 wgrad's operand of the second product.

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


def quantize_fp8_weight_layouts(w, *, pow2_scale=False):
    """w [G, K, N] -> (q [G, K, N], q_t [G, N, K], scales): (q, scales) =
    quantize_fp8_blocks(w) and q_t[g, n, k] = q[g, k, n]."""
    q, scales = quantize_fp8_blocks(w, pow2_scale=pow2_scale)
    return q, jnp.swapaxes(q, 1, 2), scales


def activate_quantize_fp8(h, *, activation: str, pow2_scale=False):
    """h [M, 2F] (gated) or [M, F] -> (a [M, F] in h's dtype, q, scales): a = the expert
    activation of h in float32 rounded to h's dtype, (q, scales) = quantize_fp8_rows(a).
    The kernels' exp / tanh are their platform's, so their a may differ from this one by
    a few ulps before rounding; their q and scales are bitwise quantize_fp8_rows of their a."""
    a = expert_activation(h.astype(jnp.float32), activation).astype(h.dtype)
    return (a, *quantize_fp8_rows(a, pow2_scale=pow2_scale))


def activate_quantize_fp8_group_cols(h, group_sizes, activation: str, *, pow2_scale=False):
    """h [M, 2F] (gated) or [M, F], group_sizes [G] -> (q, row_scales, q_t, scales):
    quantize_fp8_rows(a) and quantize_fp8_group_cols(a, group_sizes) of a, the expert
    activation of h rounded to h's dtype as activate_quantize_fp8 returns it (a itself is not
    returned). The kernels' a may differ from this one by a few ulps before rounding (their
    exp / tanh); their tilings are bitwise those of their a."""
    a = activate_quantize_fp8(h, activation=activation)[0]
    return quantize_fp8_rows_group_cols(a, group_sizes, pow2_scale=pow2_scale)


def _activation_grad(h32, da32, activation: str):
    """d/dh of sum(expert_activation(h) * da) in float32 (jax.vjp). relu's derivative is
    jax.nn.relu's rule: da where h > 0, else 0 (at h = 0 too, where the vjp of a maximum
    would split da in halves)."""
    if activation == "relu":
        return jnp.where(h32 > 0, da32, 0.0)
    _, vjp = jax.vjp(lambda v: expert_activation(v, activation), h32)
    return vjp(da32)[0]


def activate_grad_quantize_fp8(h, g, omega, *, activation: str, pow2_scale=False):
    """h [M, 2F] (gated) or [M, F], g [M, F], omega [M] float32 -> (dh [M, C] in h's dtype,
    q, scales, d_omega_tiles [M, ceil(F/128)] float32): dh = d/dh of
    sum_r omega[r] <expert_activation(h[r]), g[r]>, i.e. the derivative at da = omega * g
    (float32, not rounded), rounded to h's dtype; (q, scales) = quantize_fp8_rows(dh);
    d_omega_tiles[r, t] = sum of g[r, f] a[r, f] over f in [128 t, 128 t + 128), a =
    expert_activation(h) rounded to h's dtype (their sum over t is d/d omega[r]). The
    kernels state the derivative as formulas (common/expert_activation.h) with their
    platform's exp / tanh, so their dh may differ from this one by a few ulps before
    rounding, and their sums by their order; their q and scales are bitwise
    quantize_fp8_rows of their dh."""
    h32, g32 = h.astype(jnp.float32), g.astype(jnp.float32)
    dh = _activation_grad(h32, omega[:, None] * g32, activation).astype(h.dtype)
    a = expert_activation(h32, activation).astype(h.dtype).astype(jnp.float32)
    m, f = g.shape
    tiles = -(-f // FP8_TILE)
    products = jnp.pad(g32 * a, ((0, 0), (0, tiles * FP8_TILE - f)))
    d_omega_tiles = jnp.sum(products.reshape(m, tiles, FP8_TILE), axis=2)
    return (dh, *quantize_fp8_rows(dh, pow2_scale=pow2_scale), d_omega_tiles)


def activate_weighted_grad(h, g, omega, *, activation: str):
    """h [M, 2F] (gated) or [M, F], g [M, F], omega [M] float32 -> (dh [M, C] in h's dtype,
    d_omega [M] float32, weighted [M, F] in h's dtype), the gradients of
    sum_r omega[r] <act(h[r]), g[r]> and the weighted activation: dh = the activation's
    derivative at da = omega * g (float32, not rounded), rounded to h's dtype;
    d_omega[r] = sum_f g[r, f] a[r, f] with a = expert_activation(h) rounded to h's dtype;
    weighted = omega * a in float32, rounded to h's dtype. The kernels use their platform's
    exp / tanh and their own summation order."""
    h32, g32 = h.astype(jnp.float32), g.astype(jnp.float32)
    dh = _activation_grad(h32, omega[:, None] * g32, activation).astype(h.dtype)
    a = expert_activation(h32, activation).astype(h.dtype).astype(jnp.float32)
    return dh, jnp.sum(g32 * a, axis=1), (omega[:, None] * a).astype(h.dtype)


def fp8_scaled_element(scale, x):
    """fl(s' * x') in float32, s' and x' the operands with float32 subnormals replaced by a
    zero of their sign, and a product of magnitude at most 2^-126 replaced by a zero of its
    sign (common/fp8_blockwise.h, fp8::scaled_element): the same whether the platform
    multiplies with denormals flushed (XLA's CPU) or not."""

    def to_signed_zero(v, below_bits):  # |v| < bits_f32(below_bits) -> a zero of v's sign
        b = _f32_bits(v)
        return jnp.where((b & 0x7FFFFFFF) < below_bits, _bits_f32(b & jnp.uint32(0x80000000)), v)

    return to_signed_zero(to_signed_zero(scale, 0x00800000) * to_signed_zero(x, 0x00800000), 0x00800001)


def expand_quantize_fp8_rows(values, slots, factor, num_rows: int, *, pow2_scale=False):
    """values [T, H], slots [T, k] int32, factor [T, k] float32 -> (rows [num_rows, H] in
    values' dtype, q, scales): row r is owned by the last pair p = t * k + j (row-major)
    with slots[t, j] = r, and rows[r] = gather_rows(values, src, scale)[r] with src[r] = t,
    scale[r] = factor[t, j] (fp8_scaled_element(factor[t, j], values[t]) rounded once to
    values' dtype); rows no pair names are 0; (q, scales) = quantize_fp8_rows of the
    unscaled rows, gather_rows(values, src, 1 where a pair names the row, else 0): the
    factor does not enter them (the FP8 dgrad takes the unweighted cotangent, the bf16
    wgrad the weighted rows). factor None: every factor 1, the rows are the unscaled rows
    (the same expression as factors of ones)."""
    t, k = slots.shape
    pair = jnp.arange(t * k, dtype=jnp.int32)
    flat = slots.reshape(-1)
    named = (flat >= 0) & (flat < num_rows)
    owner = jnp.full((num_rows,), -1, jnp.int32).at[jnp.where(named, flat, num_rows)].max(pair, mode="drop")
    src = jnp.where(owner >= 0, owner // max(k, 1), -1)
    unscaled = gather_rows(values, src, jnp.where(owner >= 0, 1.0, 0.0).astype(jnp.float32))
    if factor is None:
        rows = unscaled
    elif t * k:
        rows = gather_rows(values, src, jnp.where(owner >= 0, factor.reshape(-1)[jnp.maximum(owner, 0)], 0.0))
    else:
        rows = gather_rows(values, src, jnp.zeros((num_rows,), jnp.float32))
    return (rows, *quantize_fp8_rows(unscaled, pow2_scale=pow2_scale))


def _group_col_segments(group_sizes, m: int):
    """The G + 1 segments of the wgrad tiling, in row order: the groups (clamped as
    common/grouped_gemm.h), then the rows past the last group. -> (start, first_tile,
    tiles), each [G + 1] int32: segment s has tiles = ceil(len_s / 128) tiles of 128 rows
    from its first row, numbered first_tile .. first_tile + tiles - 1 (a running sum)."""
    ends = group_ends(group_sizes, m)
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends])
    lengths = jnp.concatenate([ends, jnp.full((1,), m, jnp.int32)]) - starts
    tiles = -(-lengths // FP8_TILE)
    return starts, jnp.cumsum(tiles) - tiles, tiles


def fp8_group_col_columns(group_sizes, m: int):
    """The column of q_t (quantize_fp8_group_cols) each of the m rows goes to: row r of
    segment s, r = start_s + i, is column i % 128 of its tile first_tile_s + i // 128, i.e.
    column 128 first_tile_s + i. -> [M] int32, all below 128 (ceil(M/128) + G)."""
    starts, first_tile, _ = _group_col_segments(group_sizes, m)
    seg = row_groups(group_sizes, m)
    return (FP8_TILE * first_tile[seg] + jnp.arange(m, dtype=jnp.int32) - starts[seg]).astype(jnp.int32)


def fp8_group_col_tiles(group_sizes, m: int):
    """The wgrad tile of each of the m rows: rows split into the groups (clamped as
    common/grouped_gemm.h) and the rows past the last group, each segment cut into tiles of
    128 rows from its first row; tiles numbered in row order. -> [M] int32, all below
    ceil(M/128) + G (sum over the G + 1 segments of ceil(len / 128))."""
    return fp8_group_col_columns(group_sizes, m) // FP8_TILE


def quantize_fp8_group_cols(x, group_sizes, *, pow2_scale=False):
    """x [M, K], group_sizes [G] -> (q_t [K, 128 T] float8_e4m3fn, scales [T, K] float32),
    T = ceil(M/128) + G: x in 128 x 1 tiles along M that restart at every group boundary
    (common/fp8_blockwise.h, Fp8GroupColsParams), written transposed. One scale per column
    per tile of fp8_group_col_tiles; row r is column col(r) = fp8_group_col_columns(r) of
    q_t, in tile col(r) // 128: x[r, k] ~ q_t[k, col(r)] * scales[col(r) // 128, k].
    Columns of no row are 0, scale rows of no tile 1."""
    m, k = x.shape
    cols = fp8_group_col_columns(group_sizes, m)
    tile = cols // FP8_TILE
    t = _fp8_tiles(m) + group_sizes.shape[0]
    amax = jnp.zeros((t, k), jnp.float32).at[tile].max(fp8_magnitude(x))
    scales = fp8_scale(amax, pow2_scale)
    q = fp8_quantize(x, scales[tile])
    return jnp.zeros((k, FP8_TILE * t), q.dtype).at[:, cols].set(q.T), scales


def quantize_fp8_rows_group_cols(x, group_sizes, *, pow2_scale=False):
    """x [M, K], group_sizes [G] -> quantize_fp8_rows(x) + quantize_fp8_group_cols(x,
    group_sizes): (q, row_scales, q_t, scales), both tilings of one operand."""
    return (*quantize_fp8_rows(x, pow2_scale=pow2_scale),
            *quantize_fp8_group_cols(x, group_sizes, pow2_scale=pow2_scale))


def gather_quantize_fp8_group_cols(values, sources, factor, group_sizes, *, pow2_scale=False):
    """values [T, K], sources [M] int32, factor [M] float32 or None, group_sizes [G] ->
    (q, row_scales, q_t, scales): quantize_fp8_rows(u) and quantize_fp8_group_cols(v,
    group_sizes) of the rows gathered from values, u = gather_rows(values, sources, 1) (the
    rows with factor 1: entries of magnitude at most 2^-126 as zeros of their sign) and
    v = gather_rows(values, sources, factor) (v = u without factor); rows whose source is
    outside [0, T) are zero rows in both."""
    u = gather_rows(values, sources, jnp.ones(sources.shape, jnp.float32))
    v = u if factor is None else gather_rows(values, sources, factor)
    return (*quantize_fp8_rows(u, pow2_scale=pow2_scale),
            *quantize_fp8_group_cols(v, group_sizes, pow2_scale=pow2_scale))


def dequantize_fp8_rows(q, scales, dtype=jnp.float32):
    """q [M, K] * scales [M, ceil(K/128)] repeated over each tile's columns, in float32."""
    s = jnp.repeat(scales, FP8_TILE, axis=-1)[:, :q.shape[1]]
    return (q.astype(jnp.float32) * s).astype(dtype)


def dequantize_fp8_blocks(q, scales, dtype=jnp.float32):
    """q [G, K, N] * scales [G, ceil(K/128), ceil(N/128)] repeated over each block, in float32."""
    s = jnp.repeat(jnp.repeat(scales, FP8_TILE, axis=1), FP8_TILE, axis=2)[:, :q.shape[1], :q.shape[2]]
    return (q.astype(jnp.float32) * s).astype(dtype)


def dequantize_fp8_group_cols(q_t, scales, group_sizes, m: int, dtype=jnp.float32):
    """The [M, K] that quantize_fp8_group_cols of m rows gave (q_t [K, 128 T], scales [T, K])
    for: x[r, k] = q_t[k, col(r)] * scales[col(r) // 128, k] in float32 (col:
    fp8_group_col_columns)."""
    cols = fp8_group_col_columns(group_sizes, m)
    return (q_t[:, cols].T.astype(jnp.float32) * scales[cols // FP8_TILE]).astype(dtype)


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


# --- a float32 fma in jnp ----------------------------------------------------------------
#
# jnp has no fused multiply-add, and XLA decides alone whether a * b + c is one fma (XLA:CPU
# contracts it where the CPU has FMA, even across an optimization_barrier) or two roundings.
# fma_f32 gets the single rounding whatever XLA does: its only float products are exact (by
# powers of two), so contracting them into an addition changes nothing.


def _pow2(e):
    """2^e in float32, built from its bits, for int32 e in [-126, 127]."""
    return _bits_f32(((e + 127) << 23).astype(jnp.uint32))


def _times_pow2(x, e):
    """x * 2^e for int32 e, exact while the result is a normal float32: two products by
    powers of two, each within float32's exponent range."""
    e = jnp.clip(e, -252, 254)
    half = e >> 1
    return x * _pow2(half) * _pow2(e - half)


def _exact_product(a, b):
    """(hi, lo) with hi = fl(a * b) and hi + lo = a * b exactly, for normal float32 a and b
    (and hi, lo clear of underflow): the 48-bit product of the 24-bit significands in 12-bit
    integer limbs, rounded to 24 bits to nearest even in integers."""
    ba, bb = _f32_bits(a), _f32_bits(b)
    ma, mb = (ba & 0x7FFFFF) | 0x800000, (bb & 0x7FFFFF) | 0x800000
    ah, al, bh, bl = ma >> 12, ma & 0xFFF, mb >> 12, mb & 0xFFF
    mid = ah * bl + al * bh                          # < 2^25
    low = al * bl + ((mid & 0xFFF) << 12)            # < 2^25
    top = ah * bh + (mid >> 12) + (low >> 24)        # ma * mb >> 24, in [2^22, 2^24)
    low = low & 0xFFFFFF                             # ma * mb mod 2^24
    wide = (top >> 23) == 1                          # a 48-bit product (else 47 bits)
    keep = jnp.where(wide, top, (top << 1) | (low >> 23))           # its top 24 bits
    rest = jnp.where(wide, low, low & 0x7FFFFF)                     # the bits below them
    half = jnp.where(wide, jnp.uint32(1 << 23), jnp.uint32(1 << 22))
    up = (rest > half) | ((rest == half) & ((keep & 1) == 1))
    hi = (keep + up.astype(jnp.uint32)).astype(jnp.float32)
    lo = (rest.astype(jnp.int32) - jnp.where(up, 2 * half.astype(jnp.int32), 0)).astype(jnp.float32)
    # a * b = ma * mb * 2^(ea + eb - 300) with ea, eb the biased exponent fields.
    exp = ((ba >> 23) & 0xFF).astype(jnp.int32) + ((bb >> 23) & 0xFF).astype(jnp.int32) - 300
    sign = jnp.where(((ba ^ bb) >> 31) == 1, jnp.float32(-1.0), jnp.float32(1.0))
    return sign * _times_pow2(hi, exp + 23 + wide.astype(jnp.int32)), sign * _times_pow2(lo, exp)


def _two_sum(a, b):
    """(s, e) with s = fl(a + b) and s + e = a + b exactly (Knuth; additions only)."""
    s = a + b
    b_virtual = s - a
    return s, (a - (s - b_virtual)) + (b - b_virtual)


def _add_round_odd(a, b):
    """a + b rounded to odd: the float32 next to a + b whose last significand bit is 1,
    unless a + b is exact in float32."""
    s, e = _two_sum(a, b)
    bits = _f32_bits(s)
    toward_e = jnp.where((bits >> 31) == (_f32_bits(e) >> 31), bits + 1, bits - 1)
    return jnp.where((e != 0) & ((bits & 1) == 0), _bits_f32(toward_e), s)


def _is_normal(x):
    exponent = (_f32_bits(x) >> 23) & 0xFF
    return (exponent > 0) & (exponent < 255)


def fma_f32(a, b, c):
    """fl(a * b + c) in float32 with one rounding (to nearest even), as std::fma / CUDA's
    fmaf, whether or not XLA contracts products into sums. Boldo and Melquiond's emulation
    ("Emulation of FMA and correctly rounded sums: proved algorithms using rounding to
    odd", IEEE TC 2008): a * b = hi + lo exactly, c + hi = th + tl exactly, then
    fl(th + round_to_odd(tl + lo)). Exact for normal a and b and finite c while the
    intermediate values stay normal (|a * b| and |c| above about 2^-100, where XLA:CPU's
    flushing of subnormals would cut the error terms); zeros, infinities and NaN take the
    plain a * b + c, which rounds the same either way."""
    hi, lo = _exact_product(a, b)
    th, tl = _two_sum(c, hi)
    fused = th + _add_round_odd(tl, lo)
    return jnp.where(_is_normal(a) & _is_normal(b) & jnp.isfinite(c), fused, a * b + c)


def tgmm_fp8(lhs_t, lhs_scales, rhs_t, rhs_scales, group_sizes, *, rows, preferred_element_type=jnp.float32,
             path="auto"):
    """The FP8 wgrad of common/fp8_grouped_gemm.h (Fp8WgradParams), in its order exactly.

    lhs_t [K, 128 T] and rhs_t [N, 128 T] float8_e4m3fn with lhs_scales [T, K] and
    rhs_scales [T, N] float32: quantize_fp8_group_cols of x [M, K] and dy [M, N] with the
    same group_sizes [G], M = rows, T = ceil(rows/128) + G. For group g, over its tiles t
    in order (fp8_group_col_tiles of its rows):
        P_t[k, n] = the float32 sum over the tile's 128 columns c, in order, of
                    lhs_t[k, c] * rhs_t[n, c]                       (each product exact)
        acc       = fma_f32(fl(P_t[k, n] * lhs_scales[t, k]), rhs_scales[t, n], acc),  acc_0 = 0
    -> out [G, K, N]: acc rounded to preferred_element_type; 0 for a group with no rows.
    Bitwise the CPU kernel's (and the CUDA SIMT path's) within fma_f32's range; `path`
    (the CUDA kernel choice of the primitive) does not change the result.
    """
    del path
    k, width = lhs_t.shape
    n = rhs_t.shape[0]
    t = width // FP8_TILE
    g = group_sizes.shape[0]
    # Columns first, [128, T, K] and [128, T, N]: one scan step adds column c of every tile.
    a = lhs_t.astype(jnp.float32).reshape(k, t, FP8_TILE).transpose(2, 1, 0)
    b = rhs_t.astype(jnp.float32).reshape(n, t, FP8_TILE).transpose(2, 1, 0)

    def add_column(p, column):
        a_c, b_c = column
        return p + a_c[:, :, None] * b_c[:, None, :], None

    p, _ = jax.lax.scan(add_column, jnp.zeros((t, k, n), jnp.float32), (a, b))
    terms = p * lhs_scales[:, :, None]  # fl(P_t[k, n] * lhs_scales[t, k])
    # The group each tile belongs to; G for the rows past the groups and for unused tiles.
    _, first_tile, tiles = _group_col_segments(group_sizes, rows)
    owner = jnp.minimum(jnp.searchsorted(first_tile + tiles, jnp.arange(t, dtype=jnp.int32), side="right"), g)

    def add_tile(out, tile):
        term, scale, o = tile
        return out.at[o].set(fma_f32(term, scale[None, :], out[o])), None

    out, _ = jax.lax.scan(add_tile, jnp.zeros((g + 1, k, n), jnp.float32), (terms, rhs_scales, owner))
    return out[:g].astype(preferred_element_type)
