"""The expert MLPs of moe() and the EP layer.

    expert_mlp: out[rows of e] = act(x[rows of e] @ w_in[e]) @ w_out[e]   (two grouped GEMMs)
    shared_mlp: out = act(x @ s_in) @ s_out                                (a dense MLP)
"""

from __future__ import annotations

import functools

import jax

import moe_xla._choice as _choice
import moe_xla.first_product as first_product
import moe_xla.fp8 as fp8
from moe_xla.activations import activate
from moe_xla.first_product import GatheredRows
from moe_xla.grouped import gmm, is_fp8
from moe_xla.primitives.gather_gmm_activate import gather_gmm_activate
from moe_xla.product_combine import activate_gmm_combine, backward_gathers, gmm_combine

FUSION_MODES = ("auto", "fused", "unfused")
_fusion = _choice.Override("experts.fused_activation", FUSION_MODES)


def expert_mlp(x_sorted, w_in, w_out, group_sizes, activation: str, quantization=None, x_quantized=None,
               quantized_weights=(None, None), combine=None):
    """The experts on rows grouped by expert: out[rows of e] = act(x[rows of e] @ w_in[e]) @ w_out[e];
    rows past sum(group_sizes) give 0. x_sorted is an array, or (without quantization)
    first_product.GatheredRows, rows the first product reads from where they lie (the
    tokens, or the rows an EP rank received). Both products in the precision
    `quantization` names (moe_xla.gmm's option); h and act(h) stay in x's dtype.
    x_quantized: with "fp8_blockwise", quantize_fp8_rows(x_sorted) made elsewhere (moe()
    gathers the tokens' quantised rows), used by the first product instead of quantising
    x_sorted again. With "fp8_blockwise" the activation and the quantisation of its output
    are one kernel, and so are its backward and the quantisation of d h
    (fp8.gmm_activate_fp8). quantized_weights: with "fp8_blockwise", Fp8Weights of w_in and
    w_out made elsewhere, used by the products instead of quantising the arrays (which
    still get their gradients). combine = (row_map, weights, row_pairs) of permute
    (return_row_pairs=True) and route: returns the weighted combine
    unpermute(out, row_map, weights) [T, H] instead of out, through
    product_combine.activate_gmm_combine (whose derivative needs neither out nor a weighted
    copy of the cotangent); with GatheredRows (whose token_slots are combine's row_map) the
    forward runs the activation in the first product's epilogue where `fused_activation`
    says (_fused_forward_mlp); with "fp8_blockwise" the MLP and the combine are one
    custom_vjp with the same derivative's form (fp8.mlp_combine_fp8)."""
    if is_fp8(quantization):
        q_in, q_out = quantized_weights
        wgrad = fp8.QUANTIZATION_WGRAD[quantization]
        if combine is not None:
            return fp8.mlp_combine_fp8(x_sorted, w_in, w_out, group_sizes, *combine, activation,
                                       x_quantized=x_quantized, quantized_weights=(q_in, q_out), wgrad=wgrad)
        # One custom_vjp for the first product and the activation (under their scopes): one
        # pass over h writes a (for the wgrad) and its FP8 rows (for the second product), one
        # pass over h and d a writes d h and its FP8 rows (for the first product's dgrad).
        a, *a_quantized = fp8.gmm_activate_fp8(x_sorted, w_in, group_sizes, activation, lhs_quantized=x_quantized,
                                               rhs_quantized=q_in, wgrad=wgrad)
        with jax.named_scope("moe_xla/gmm_out"):
            return fp8.gmm_fp8_blockwise(a, w_out, group_sizes, lhs_quantized=tuple(a_quantized), rhs_quantized=q_out,
                                         wgrad=wgrad)
    if isinstance(x_sorted, GatheredRows) and combine is not None:
        # combine's row_map is x_sorted's token_slots flattened (both permute's, or both the
        # EP layer's slots of its received rows).
        rows, (_, weights, row_pairs) = x_sorted, combine
        args = (rows, w_in, w_out, group_sizes, weights, row_pairs)
        if _activation_fuses(rows, w_in, activation):
            return _fused_forward_mlp(*args, activation)
        return _gathered_mlp(*args, activation=activation)
    with jax.named_scope("moe_xla/gmm_in"):
        if isinstance(x_sorted, GatheredRows):
            h = x_sorted.gmm(w_in, group_sizes)
        else:
            h = gmm(x_sorted, w_in, group_sizes, quantization=quantization)
    if combine is not None:
        row_map, weights, row_pairs = combine
        return _activate_product_combine(h, w_out, group_sizes, row_map, weights, row_pairs, activation,
                                         backward_gathers(h, w_out, weights.shape[0]))
    with jax.named_scope("moe_xla/act"):
        a = activate(h, activation)
    with jax.named_scope("moe_xla/gmm_out"):
        return gmm(a, w_out, group_sizes, quantization=quantization)


def fused_activation(mode: str):
    """Within the block, whether moe()'s gathered expert MLP runs its forward with the
    activation in the first product's epilogue: "fused", "unfused", or "auto"
    (first_product.activation_fuses: where the fused kernel runs). For tests and
    benchmarks; a function jitted under one mode keeps it in its compiled programs."""
    return _fusion.forced(mode)


def _activation_fuses(rows: GatheredRows, w_in, activation: str) -> bool:
    if _fusion.mode != "auto":
        return _fusion.mode == "fused"
    return first_product.activation_fuses(rows.x, w_in, rows.token_slots.shape[1], activation)


@functools.partial(jax.custom_jvp, nondiff_argnums=(6,))
def _fused_forward_mlp(rows: GatheredRows, w_in, w_out, group_sizes, weights, row_pairs, activation: str):
    """The gathered expert MLP and weighted combine, y [T, H], computed with the activation in
    the first product's epilogue (gather_gmm_activate: h stays float32, a is rounded once)
    where no nonzero tangent reaches it. Its derivative, and its values where a tangent
    does, are those of the unfused path (_gathered_mlp), which keeps h for the backward: the
    two differ by the rounding of h to x's dtype."""
    with jax.named_scope("moe_xla/gmm_in"):
        a = gather_gmm_activate(rows.x, rows.src, w_in, group_sizes, activation)
    return gmm_combine(a, w_out, group_sizes, rows.token_slots.reshape(-1), weights, row_pairs)


@_fused_forward_mlp.defjvp
def _fused_forward_mlp_jvp(activation, primals, tangents):
    return jax.jvp(functools.partial(_gathered_mlp, activation=activation), primals, tangents)


def _gathered_mlp(rows: GatheredRows, w_in, w_out, group_sizes, weights, row_pairs, *, activation: str):
    """expert_mlp's unfused path on first_product.GatheredRows `rows` with combine =
    (rows.token_slots flattened, weights, row_pairs)."""
    with jax.named_scope("moe_xla/gmm_in"):
        h = rows.gmm(w_in, group_sizes)
    row_map = rows.token_slots.reshape(-1)
    return _activate_product_combine(h, w_out, group_sizes, row_map, weights, row_pairs, activation,
                                     backward_gathers(h, w_out, weights.shape[0]))


@functools.partial(jax.checkpoint, static_argnums=(6, 7))
def _activate_product_combine(h, w_out, group_sizes, row_map, weights, row_pairs, activation: str,
                              gathered_backward: bool):
    """activate_gmm_combine(h, w_out, ...), rematerialised: a step keeps h, which the
    activation's backward reads anyway (its one pass also writes omega * a for w_out's
    gradient), instead of keeping a [T*k, F] array."""
    return activate_gmm_combine(h, w_out, group_sizes, row_map, weights, row_pairs, activation, gathered_backward)


def shared_mlp(x, shared_experts, activation: str):
    """The shared experts, a dense MLP every token passes through: act(x @ s_in) @ s_out."""
    with jax.named_scope("moe_xla/shared"):
        s_in, s_out = shared_experts
        return activate(x @ s_in, activation) @ s_out
