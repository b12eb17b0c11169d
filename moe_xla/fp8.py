"""FP8 blockwise grouped products that differentiate: the DeepSeek-V3 recipe on Hopper.

    Fp8Weights            expert weights w [G, K, N] quantised in 128 x 128 blocks, held in
                          the two layouts the products read (data [G, K, N] for the dgrad,
                          data_t [G, N, K] for the forward; 2 bytes per weight in all, as bf16)
                          and one scale per block, scales [G, ceil(K/128), ceil(N/128)].
    quantize_fp8_weights  w -> Fp8Weights (once per step; or once, for frozen weights): one
                          kernel writes the blocks in both layouts and their scales.
    dequantize_fp8_rows   (q, scales) of quantize_fp8_rows -> the values they stand for,
                          q[r, k] * scales[r, k // 128] in float32, then in a dtype.
    gmm_fp8_blockwise     out[rows of g] = lhs[rows of g] @ w[g] with lhs quantised in 1 x 128
                          row tiles and w in 128 x 128 blocks (moe_xla.gmm(quantization=
                          "fp8_blockwise") calls it).
    gmm_activate_fp8      the expert MLP's first product and its activation:
                          (a, q_a, s_a) = activate_quantize_fp8(gmm_fp8_blockwise(x, w)), whose
                          backward computes d h and its FP8 rows in one kernel
                          (activate_grad_quantize_fp8) for the product's dgrad.
    mlp_combine_fp8       the whole expert MLP and the weighted combine, y = unpermute(
                          gmm_fp8_blockwise(a, w_out), row_map, weights), whose backward
                          quantises the unweighted cotangent as it expands it
                          (expand_quantize_fp8_rows) and applies the routing weights in the
                          activation's backward, which also gives their gradient.

Forward: out = gmm_fp8(Q_rows(lhs), Q_blocks(w)) (primitives/gmm_fp8.py states the sum).
Backward, the straight-through estimate (quantisation's derivative taken as 1):
    d lhs = gmm_fp8(Q_rows(dy), Q_blocks(w)^T): dy quantised in 1 x 128 tiles along N, the
            forward's weight blocks transposed (no requantisation);
    d w   = wgrad="bf16" (the default): tgmm(lhs, dy) in lhs's dtype (bf16 for a bf16 model)
            with float32 accumulation;
            wgrad="fp8": tgmm_fp8 of lhs and dy quantised in 128-row column tiles that
            restart at every group (quantize_fp8_group_cols, written transposed so that
            each group is a K-major product whose depth is its rows), one scale per column
            of each operand per tile. lhs's tiles are made in the forward and kept instead
            of lhs; where the forward quantises lhs itself, its row tiles and column tiles
            come from one read of it (quantize_fp8_rows_group_cols), and so do dy's.
The default is the bf16 wgrad because it is the more accurate: against a float32 layer the
FP8 wgrad's weight gradients are off by 6.3-6.5% (relative Frobenius error, bf16 inputs)
where the bf16 wgrad's are off by 5.3-5.5% (both dominated by the FP8 forward's error in
dy; the bf16 layer's: 0.4%; benchmarks/results/LOG.md, session 12). It is no longer the
faster one everywhere: with our wgrad kernel (session 43, H100) the FP8 wgrad GEMM runs
1.24-1.34x the bf16 tgmm, a backward pair of FP8 dgrad + FP8 wgrad (quantisations
included) 1.11-1.31x bf16's on the deepseek-v3 and mixtral cases, and the layer's
forward+backward 1.15x / 1.31x bf16's on deepseek-v3-like / mixtral against 1.15x / 1.23x
with the bf16 wgrad; on qwen3-30b-a3b (K 2048 and 768) the two group-column quantisations
cost more than the GEMM saves (layer 0.96x against 1.03x); gmm's backward, with dy's two
tilings from one read and x's column tiles made by the forward (session 44; not counting
that forward pass), 1.19x / 1.02x bf16's on those products.
moe_xla.gmm / moe() select it with quantization="fp8_blockwise_fp8_wgrad".
Pre-quantised weights (an Fp8Weights as rhs) get no gradient. To quantise weights once and
still train them (e.g. once per optimizer step for several micro-batches), pass the array
as rhs and its Fp8Weights as rhs_quantized: the products use rhs_quantized as given, the
wgrad goes to rhs.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

import moe_xla._rows as _rows
from moe_xla.primitives import _fp8
from moe_xla.primitives._activation import GATED
from moe_xla.primitives.activate_grad_quantize_fp8 import activate_grad_quantize_fp8
from moe_xla.primitives.activate_quantize_fp8 import activate_quantize_fp8
from moe_xla.primitives.activate_quantize_fp8_group_cols import activate_quantize_fp8_group_cols
from moe_xla.primitives.expand_quantize_fp8_rows import expand_quantize_fp8_rows
from moe_xla.primitives.gather_quantize_fp8_group_cols import gather_quantize_fp8_group_cols
from moe_xla.primitives.gmm_fp8 import gmm_fp8
from moe_xla.primitives.quantize_fp8_group_cols import quantize_fp8_group_cols
from moe_xla.primitives.quantize_fp8_rows import quantize_fp8_rows
from moe_xla.primitives.quantize_fp8_rows_group_cols import quantize_fp8_rows_group_cols
from moe_xla.primitives.quantize_fp8_weight_layouts import quantize_fp8_weight_layouts
from moe_xla.primitives.tgmm import tgmm
from moe_xla.primitives.tgmm_fp8 import tgmm_fp8
from moe_xla.primitives.unpermute import unpermute

WGRADS = ("fp8", "bf16")
# The FP8 values of moe_xla.gmm's and moe()'s `quantization`, by the wgrad they take.
QUANTIZATION_WGRAD = {"fp8_blockwise": "bf16", "fp8_blockwise_fp8_wgrad": "fp8"}


class Fp8Weights(NamedTuple):
    """Expert weights w [G, K, N] in 128 x 128 FP8 blocks (see the module docstring)."""

    data: jax.Array    # [G, K, N] float8_e4m3fn
    data_t: jax.Array  # [G, N, K] float8_e4m3fn, data with its last two axes swapped
    scales: jax.Array  # [G, ceil(K/128), ceil(N/128)] float32

    @property
    def shape(self):
        """(G, K, N): the shape of the weights it holds."""
        return self.data.shape


class TokenRows(NamedTuple):
    """A product's rows named by the token rows they copy, for the product to quantise: row
    r is tokens[t] for the pair (t, j) that row_pairs[r] names (permute's row_map and
    row_pairs, T * k pairs). Given as a product's quantised rows (lhs_quantized,
    x_quantized), it is quantised in one pass over the tokens, by the kernel the product
    needs: the FP8 rows alone where no derivative is taken (expand_quantize_fp8_rows), the
    rows and the FP8 wgrad's column tiles where one is (gather_quantize_fp8_group_cols), so
    a forward alone makes no column tiles."""

    tokens: jax.Array     # [T, H]
    row_map: jax.Array    # [T * k] int32
    row_pairs: jax.Array  # [R] int32

    def _pairs(self):
        t = self.tokens.shape[0]
        return t, self.row_map.shape[0] // t

    def sources(self):
        """[R] the token of each row."""
        return _rows.pair_sources(self.row_pairs, self._pairs())[0]

    def expand(self):
        """(rows [T * k, H] in the tokens' dtype, q, scales): the sorted rows and their FP8
        row tiles (expand_quantize_fp8_rows, every factor 1)."""
        t, k = self._pairs()
        return tuple(expand_quantize_fp8_rows(self.tokens, self.row_map.reshape(t, k), None, t * k))

    def rows_and_cols(self, group_sizes):
        """(q, scales, q_t, scales_t): the rows' FP8 row tiles and the FP8 wgrad's column
        tiles over group_sizes, with no copy of the rows (gather_quantize_fp8_group_cols)."""
        return tuple(gather_quantize_fp8_group_cols(self.tokens, self.sources(), None, group_sizes))


def quantize_fp8_weights(w, *, pow2_scale=False) -> Fp8Weights:
    """w [G, K, N] -> Fp8Weights (128 x 128 blocks; no gradient flows through): data and
    scales are quantize_fp8_blocks(w), data_t is data with its last two axes swapped, all
    three written by one kernel (quantize_fp8_weight_layouts)."""
    if jnp.ndim(w) != 3:
        raise ValueError(f"quantize_fp8_weights: expected w of rank 3 [G, K, N], got shape {jnp.shape(w)}")
    return Fp8Weights(*quantize_fp8_weight_layouts(jax.lax.stop_gradient(w), pow2_scale=pow2_scale))


def dequantize_fp8_rows(q, scales, dtype=jnp.float32):
    """The [M, K] values that quantize_fp8_rows' (q [M, K] float8_e4m3fn, scales [M, Kt]
    float32, Kt = ceil(K / 128)) stand for: the float32 product q[r, k] * scales[r, k // 128],
    then converted to `dtype` (reference.dequantize_fp8_rows states the same)."""
    if q.ndim != 2 or scales.ndim != 2 or scales.shape != (q.shape[0], -(-q.shape[1] // _fp8.TILE)):
        raise ValueError(f"dequantize_fp8_rows: expected q [M, K] and scales [M, ceil(K/128)], got q "
                         f"{tuple(q.shape)} and scales {tuple(scales.shape)}")
    if jnp.dtype(q.dtype) != jnp.dtype(jnp.float8_e4m3fn) or jnp.dtype(scales.dtype) != jnp.dtype(jnp.float32):
        raise TypeError(f"dequantize_fp8_rows: expected float8_e4m3fn q and float32 scales, got {q.dtype} and "
                        f"{scales.dtype}")
    s = jnp.repeat(scales, _fp8.TILE, axis=1)[:, :q.shape[1]]
    return (q.astype(jnp.float32) * s).astype(dtype)


def _kernel_dtype(dtype):
    """The kernels write bf16 or f32; other dtypes are cast from f32."""
    return jnp.dtype(jnp.bfloat16) if jnp.dtype(dtype) == jnp.bfloat16 else jnp.dtype(jnp.float32)


def _product(rows, data, scales, group_sizes, out_dtype):
    """gmm_fp8 of FP8 rows (q, scales) (_operands)."""
    q, s = rows
    return gmm_fp8(q, s, data, scales, group_sizes, preferred_element_type=_kernel_dtype(out_dtype)).astype(out_dtype)


def _operands(v, v_q, group_sizes, fp8_wgrad):
    """(v's FP8 rows, what the wgrad takes of v) for an operand v of a product: the rows
    as given (v_q) or made here; for the FP8 wgrad v's column tiles (q_t, scales) instead
    of v, from the same read of v as the rows where those are made here. v_q may hold
    the column tiles too, (q, scales, q_t, scales_t) made by the kernel that made v's rows
    (gather_quantize_fp8_group_cols, activate_quantize_fp8_group_cols): then v is not read;
    or be TokenRows, quantised here from the tokens."""
    if isinstance(v_q, TokenRows):
        if fp8_wgrad:
            q, s, q_t, s_t = v_q.rows_and_cols(group_sizes)
            return (q, s), (q_t, s_t)
        return v_q.expand()[1:], v
    if v_q is not None and len(v_q) == 4:
        return tuple(v_q[:2]), (tuple(v_q[2:]) if fp8_wgrad else v)
    if not fp8_wgrad:
        return (tuple(quantize_fp8_rows(v)) if v_q is None else v_q), v
    if v_q is None:
        q, s, q_t, s_t = quantize_fp8_rows_group_cols(v, group_sizes)
        return (q, s), (q_t, s_t)
    return v_q, tuple(quantize_fp8_group_cols(v, group_sizes))


def _wgrad(lhs, dy, group_sizes, rows, w_dtype, wgrad):
    """d w[g] = lhs[rows of g]^T @ dy[rows of g] over `rows` rows: FP8 over 128-row tiles
    of each group ("fp8"; lhs and dy as their column tiles, _operands), or tgmm in lhs's
    dtype with float32 accumulation ("bf16")."""
    if wgrad == "bf16":
        return tgmm(lhs, dy.astype(lhs.dtype), group_sizes, preferred_element_type=w_dtype)
    return tgmm_fp8(*lhs, *dy, group_sizes, rows=rows, preferred_element_type=_kernel_dtype(w_dtype)).astype(w_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _gmm(lhs, lhs_q, w, weights, group_sizes, out_dtype, wgrad):
    return _product(_operands(lhs, lhs_q, group_sizes, False)[0], weights.data_t, weights.scales, group_sizes,
                    out_dtype)


def _gmm_fwd(lhs, lhs_q, w, weights, group_sizes, out_dtype, wgrad):
    rows, lhs_wgrad = _operands(lhs, lhs_q, group_sizes, w is not None and wgrad == "fp8")
    out = _product(rows, weights.data_t, weights.scales, group_sizes, out_dtype)
    # Residuals are arrays: dtypes ride along as empty arrays.
    lhs_dtype = jnp.zeros((0,), lhs.dtype)
    wgrad = None if w is None else (lhs_wgrad, jnp.zeros((0,), w.dtype))
    return out, (weights, group_sizes, lhs_dtype, wgrad)


def _grads(dy, dy_quantized, residuals, wgrad_kind):
    """The backward of a product given dy and its FP8 rows (q, scales) (or None: quantised
    here, with the FP8 wgrad's column tiles from the same read of dy; or with the column
    tiles, (q, scales, q_t, scales_t), when dy gives its shape alone): d lhs in FP8
    through the weights' blocks transposed, d w as _wgrad says. The quantised operands
    get no cotangent (None: zeros, nothing kept for them)."""
    weights, group_sizes, lhs_dtype, wgrad = residuals
    rows, dy_wgrad = _operands(dy, dy_quantized, group_sizes, wgrad is not None and wgrad_kind == "fp8")
    d_lhs = _product(rows, weights.data, jnp.swapaxes(weights.scales, 1, 2), group_sizes, lhs_dtype.dtype)
    d_w = None
    if wgrad is not None:
        lhs, w_dtype = wgrad
        d_w = _wgrad(lhs, dy_wgrad, group_sizes, dy.shape[0], w_dtype.dtype, wgrad_kind)
    return d_lhs, None, d_w, None, None


def _gmm_bwd(out_dtype, wgrad_kind, residuals, dy):
    return _grads(dy, None, residuals, wgrad_kind)


_gmm.defvjp(_gmm_fwd, _gmm_bwd)


# The expert MLP's scopes (moe_layer_stages.py attributes kernels by them), set here since
# one custom_vjp spans the first product and the activation (gmm_activate_fp8), another
# the whole MLP and the combine (mlp_combine_fp8).
_PRODUCT, _ACT, _PRODUCT_OUT, _COMBINE = "moe_xla/gmm_in", "moe_xla/act", "moe_xla/gmm_out", "moe_xla/combine"


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _gmm_act(lhs, lhs_q, w, weights, group_sizes, activation, wgrad):
    # Without a derivative no wgrad operand is needed: the forward of the bf16 wgrad (the
    # same output) makes none.
    return _gmm_act_fwd(lhs, lhs_q, w, weights, group_sizes, activation, "bf16")[0]


def _gmm_act_fwd(lhs, lhs_q, w, weights, group_sizes, activation, wgrad, column_tiles=False):
    """(a, q, scales) and the residuals; with column_tiles (a, q, scales, q_t, scales_t),
    a's column tiles for the FP8 wgrad of the next product from the same kernel, which then
    writes no a: a is its shape and dtype alone."""
    with jax.named_scope(_PRODUCT):
        h, residuals = _gmm_fwd(lhs, lhs_q, w, weights, group_sizes, lhs.dtype, wgrad)
    with jax.named_scope(_ACT):
        if column_tiles:
            f = h.shape[1] // 2 if activation in GATED else h.shape[1]
            out = (jax.ShapeDtypeStruct((h.shape[0], f), h.dtype),
                   *activate_quantize_fp8_group_cols(h, group_sizes, activation))
        else:
            out = activate_quantize_fp8(h, activation)
    return out, (h, residuals)


def _gmm_act_bwd(activation, wgrad_kind, saved, cotangents):
    h, residuals = saved
    with jax.named_scope(_ACT):
        ones = jnp.ones(h.shape[:1], jnp.float32)
        dh, q, scales, _ = activate_grad_quantize_fp8(h, cotangents[0].astype(h.dtype), ones, activation)
    with jax.named_scope(_PRODUCT):
        return _grads(dh, (q, scales), residuals, wgrad_kind)


_gmm_act.defvjp(_gmm_act_fwd, _gmm_act_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(10, 11))
def _mlp_combine(x, x_q, w_in, q_in, w_out, q_out, group_sizes, row_map, route_weights, row_pairs, activation,
                 wgrad):
    return _mlp_combine_fwd(x, x_q, w_in, q_in, w_out, q_out, group_sizes, row_map, route_weights, row_pairs,
                            activation, "bf16")[0]  # as _gmm_act: no wgrad operand without a derivative


def _mlp_combine_fwd(x, x_q, w_in, q_in, w_out, q_out, group_sizes, row_map, route_weights, row_pairs, activation,
                     wgrad):
    (a, *a_q), (h, res_in) = _gmm_act_fwd(x, x_q, w_in, q_in, group_sizes, activation, wgrad,
                                          column_tiles=wgrad == "fp8" and w_out is not None)
    with jax.named_scope(_PRODUCT_OUT):
        out, res_out = _gmm_fwd(a, tuple(a_q), w_out, q_out, group_sizes, x.dtype, wgrad)
    with jax.named_scope(_COMBINE):
        y = unpermute(out, row_map, route_weights, row_pairs=row_pairs)
    return y, (h, res_in, res_out, row_map, route_weights, row_pairs)


def _mlp_combine_bwd(activation, wgrad_kind, saved, dy):
    h, res_in, res_out, row_map, route_weights, row_pairs = saved
    (t, k), m = route_weights.shape, h.shape[0]
    weights32 = route_weights.astype(jnp.float32)
    with jax.named_scope(_COMBINE):
        # d out[r] = omega[r] dy[t] (unpermute's transpose); the FP8 rows are those of dy[t]
        # itself, c[r] (the weight enters after the product). For the FP8 wgrad only the
        # column tiles of d out are needed, gathered from dy with omega (d out never
        # written); for the bf16 wgrad d out itself, each dy row read once.
        src, omega = _rows.pair_sources(row_pairs, (t, k), weights32)
        _, group_sizes, _, out_wgrad = res_out
        c = dy.astype(h.dtype)
        if wgrad_kind == "fp8" and out_wgrad is not None:
            d_out = jax.ShapeDtypeStruct((m, dy.shape[1]), h.dtype)  # _grads reads its shape only
            d_out_quantized = gather_quantize_fp8_group_cols(c, src, omega, group_sizes)
        else:
            d_out, *d_out_quantized = expand_quantize_fp8_rows(c, row_map.reshape(t, k), weights32, m)
    with jax.named_scope(_PRODUCT_OUT):
        g, _, d_w_out, d_q_out, _ = _grads(d_out, tuple(d_out_quantized), res_out, wgrad_kind)
    with jax.named_scope(_ACT):
        # d h and its row tiles here; with the FP8 wgrad, _grads then makes d h's column tiles
        # (quantize_fp8_group_cols): two kernels, faster here than one making both tilings
        # (docs/performance.md, "FP8 wgrad").
        dh, q_h, s_h, d_omega = activate_grad_quantize_fp8(h, g.astype(h.dtype), omega, activation)
    with jax.named_scope(_PRODUCT):
        d_x, d_x_q, d_w_in, d_q_in, _ = _grads(dh, (q_h, s_h), res_in, wgrad_kind)
    with jax.named_scope(_COMBINE):
        # omega's transpose: d weights[t, j] = d omega[row_map[t*k + j]], a gather.
        (d_route,) = jax.linear_transpose(lambda w: _rows.row_weights(row_map, w, m), weights32)(d_omega)
    return d_x, d_x_q, d_w_in, d_q_in, d_w_out, d_q_out, None, None, d_route.astype(route_weights.dtype), None


_mlp_combine.defvjp(_mlp_combine_fwd, _mlp_combine_bwd)


def _weights(op, rhs, rhs_quantized, transpose_rhs=False):
    """(w as [G, K, N] or None for an Fp8Weights rhs, the Fp8Weights the products use):
    rhs quantised here unless rhs_quantized is given (see gmm_fp8_blockwise)."""
    if isinstance(rhs, Fp8Weights):
        if transpose_rhs:
            raise ValueError(f"{op}: transpose_rhs must be False for Fp8Weights "
                             "(the container holds w [G, K, N] in both layouts)")
        return None, rhs
    if jnp.ndim(rhs) != 3:
        raise ValueError(f"{op}: expected rhs of rank 3, got shape {jnp.shape(rhs)}")
    w = jnp.swapaxes(rhs, 1, 2) if transpose_rhs else rhs
    if rhs_quantized is None:
        return w, quantize_fp8_weights(w)
    if not isinstance(rhs_quantized, Fp8Weights):
        raise TypeError(f"{op}: expected rhs_quantized to be an Fp8Weights "
                        f"(moe_xla.quantize_fp8_weights), got {type(rhs_quantized).__name__}")
    if tuple(rhs_quantized.shape) != tuple(w.shape):
        raise ValueError(f"{op}: expected rhs_quantized of the weights' shape "
                         f"{tuple(w.shape)} [G, K, N], got {tuple(rhs_quantized.shape)}")
    return w, jax.tree.map(jax.lax.stop_gradient, rhs_quantized)


def _check_wgrad(op, wgrad):
    if wgrad not in WGRADS:
        raise ValueError(f"{op}: expected wgrad in {WGRADS}, got {wgrad!r}")


def _stopped(lhs_quantized):
    if lhs_quantized is None:
        return None
    kept = lhs_quantized if isinstance(lhs_quantized, TokenRows) else tuple(lhs_quantized)
    return jax.tree.map(jax.lax.stop_gradient, kept)


def gmm_activate_fp8(lhs, rhs, group_sizes, activation: str, *, lhs_quantized=None, rhs_quantized=None, wgrad="bf16"):
    """(a, q, scales) = activate_quantize_fp8(gmm_fp8_blockwise(lhs, rhs, group_sizes), activation):
    the FP8 expert MLP's first product h [M, 2F or F] (in lhs's dtype) and the activation
    a [M, F] with its 1 x 128 FP8 rows for the second product. lhs, rhs, lhs_quantized and
    rhs_quantized as gmm_fp8_blockwise's. Differentiable w.r.t. lhs and an array rhs
    through a (q and scales get no cotangent): the backward computes d h = act'(h) da and
    its FP8 rows in one kernel (activate_grad_quantize_fp8, a few ulps from jax.vjp of the
    jnp activation), then the product's rules with those rows: d lhs in FP8, d w in the
    precision wgrad names (gmm_fp8_blockwise's)."""
    _check_wgrad("gmm_activate_fp8", wgrad)
    with jax.named_scope(_PRODUCT):
        w, weights = _weights("gmm_activate_fp8", rhs, rhs_quantized)
    return _gmm_act(lhs, _stopped(lhs_quantized), w, weights, group_sizes, activation, wgrad)


def mlp_combine_fp8(x, w_in, w_out, group_sizes, row_map, weights, row_pairs, activation: str, *, x_quantized=None,
                    quantized_weights=(None, None), wgrad="bf16"):
    """y[t] = sum_j weights[t, j] out[row_map[t*k + j]] with out = gmm_fp8_blockwise(a, w_out)
    and (a, ...) = gmm_activate_fp8(x, w_in, group_sizes, activation): the FP8 expert MLP on
    rows x [R, H] grouped by expert and its weighted combine into [T, N] (row_map [T*k] names
    each row at most once, row_pairs [R] is its inverse, as permute's are, R = T*k there;
    weights [T, k]). x_quantized (quantize_fp8_rows(x), or TokenRows of x) and
    quantized_weights = (Fp8Weights of w_in or None, of w_out or None) as lhs_quantized and
    rhs_quantized of gmm_fp8_blockwise; wgrad likewise. Differentiable w.r.t. x, array
    weights w_in / w_out and weights, by the rule of product_combine's derivative with the
    routing weight omega[r] (of the pair naming row r) moved in front of the second
    product: with c[r] = dy[t] (r = row_map[t*k + j]),
        g = gmm_fp8(Q_rows(c), Q_blocks(w_out)^T)      (the dgrad of the unweighted cotangent)
        d h, Q_rows(d h), d omega = act'(h)^T (omega g), <g, act(h)>   (one kernel:
                                                        activate_grad_quantize_fp8)
        d w_out = a^T (omega c)                         (bf16 or FP8 wgrad, as gmm_fp8_blockwise's)
        d weights[t, j] = d omega[row_map[t*k + j]]
    One pass over dy writes omega c (for the wgrad) and the FP8 rows of c
    (expand_quantize_fp8_rows); with the FP8 wgrad it writes the FP8 rows of c and the
    column tiles of omega c instead (gather_quantize_fp8_group_cols: omega c never stored),
    and the activation's kernel writes a's column tiles with its rows
    (activate_quantize_fp8_group_cols: a never stored). Neither the product's output nor
    a weighted copy of g is kept or written: a step saves h, a (with the FP8 wgrad the
    column tiles of x and a instead of x and a) and the weights' layouts. The FP8 dgrad multiplies
    Q_rows(c), not Q_rows(omega c) as the unfused rule would (the same up to the
    quantisation's rounding)."""
    _check_wgrad("mlp_combine_fp8", wgrad)
    if jnp.shape(row_pairs) != jnp.shape(x)[:1]:
        raise ValueError(f"mlp_combine_fp8: expected row_pairs of shape {jnp.shape(x)[:1]} (one per row of x), "
                         f"got {jnp.shape(row_pairs)}")
    q_in, q_out = quantized_weights
    with jax.named_scope(_PRODUCT):
        w_in, q_in = _weights("mlp_combine_fp8", w_in, q_in)
    with jax.named_scope(_PRODUCT_OUT):
        w_out, q_out = _weights("mlp_combine_fp8", w_out, q_out)
    return _mlp_combine(x, _stopped(x_quantized), w_in, q_in, w_out, q_out, group_sizes, row_map, weights,
                        row_pairs, activation, wgrad)


def gmm_fp8_blockwise(lhs, rhs, group_sizes, *, transpose_rhs=False, preferred_element_type=None,
                      lhs_quantized=None, rhs_quantized=None, wgrad="bf16"):
    """out[rows of g] = lhs[rows of g] @ rhs[g] (rhs[g]^T with transpose_rhs) in FP8 blockwise.

    lhs [M, K] float32 / bfloat16 / float16; rhs [G, K, N] ([G, N, K] with transpose_rhs) of a
    float dtype, or an Fp8Weights of w [G, K, N] (transpose_rhs False); group_sizes [G] int32.
    Returns [M, N] in preferred_element_type (default lhs.dtype), differentiable w.r.t. lhs
    and an array rhs (see the module docstring for the rules). lhs_quantized, if given, is
    quantize_fp8_rows(lhs) made elsewhere (e.g. on the tokens before they were gathered
    into lhs: 1 x 128 row tiles do not depend on the row order); the forward uses it as is.
    rhs_quantized, if given with an array rhs, is an Fp8Weights of rhs as [G, K, N]
    (quantize_fp8_weights, made once elsewhere): the products use it instead of quantising
    rhs, and rhs still gets its (bf16) gradient. It is used as given: weights quantised
    from other values give that forward and the gradient of rhs the backward rule states.
    wgrad ("bf16" or "fp8") picks the weight gradient's precision (module docstring).
    """
    op = "gmm(quantization='fp8_blockwise')"
    _check_wgrad(op, wgrad)
    out_dtype = jnp.dtype(preferred_element_type or lhs.dtype)
    w, weights = _weights(op, rhs, rhs_quantized, transpose_rhs)
    return _gmm(lhs, _stopped(lhs_quantized), w, weights, group_sizes, out_dtype, wgrad)
