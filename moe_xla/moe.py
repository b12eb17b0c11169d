"""moe(): a dropless Mixture-of-Experts layer from the moe_xla primitives.

    weights, ids = route(router_logits)                       # [T, k] each
    x_sorted, group_sizes, row_map = permute(x, ids, E)       # rows grouped by expert (and
                                                              #   row_pairs, row_map's inverse)
    h = gmm(x_sorted, w_in, group_sizes)                      # [T*k, 2F] (gated) or [T*k, F]
      (or permute's sort alone and h = gather_gmm(x, src, w_in, group_sizes), reading
       x_sorted[r] = x[src[r]] from the tokens: moe_xla/first_product.py)
    a = act(h)                                                # swiglu: silu(h[:, :F]) * h[:, F:]
    y_sorted = gmm(a, w_out, group_sizes)                     # [T*k, H]
    y = unpermute(y_sorted, row_map, weights)                 # sum_j weights[t, j] * y_e_j(x[t])
    (+ shared expert: act(x @ shared_in) @ shared_out, added to every token)

Every routed (token, expert) pair is computed: no capacity, no padding, no dropped
token, no host synchronisation. Each stage runs under jax.named_scope("moe_xla/<stage>").
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

import moe_xla._rows as _rows
import moe_xla.first_product as first_product
from moe_xla.activations import ACTIVATIONS, GATED
from moe_xla.aux_losses import router_aux
from moe_xla.ep.layer import moe_ep
from moe_xla.experts import expert_mlp, shared_mlp
from moe_xla.fp8 import QUANTIZATION_WGRAD, Fp8Weights, TokenRows
from moe_xla.grouped import check_quantization, is_fp8
from moe_xla.primitives import _checks
from moe_xla.primitives.permute import permute
from moe_xla.primitives.route import route


def _check(x, router_logits, w_in, w_out, top_k, activation, shared_experts, quantization):
    check_quantization("moe", quantization)
    if activation not in ACTIVATIONS:
        raise ValueError(f"moe: expected activation in {ACTIVATIONS}, got {activation!r}")
    if x.ndim < 2:
        raise ValueError(f"moe: expected x of rank >= 2 [..., H], got shape {x.shape}")
    _checks.float_dtype("moe", "x", x)
    tokens, hidden = x.size // x.shape[-1], x.shape[-1]
    _checks.rank("moe", "w_in", w_in, 3, "[E, H, 2F] or [E, H, F]")
    _checks.rank("moe", "w_out", w_out, 3, "[E, F, H]")
    experts = w_in.shape[0]
    if router_logits.shape != x.shape[:-1] + (experts,):
        raise ValueError(f"moe: expected router_logits of shape {x.shape[:-1] + (experts,)} (x's leading dims, E), "
                         f"got {router_logits.shape}")
    _checks.dim("moe", "w_in.shape[1] (H of x)", hidden, w_in.shape[1])
    f = w_in.shape[2] // 2 if activation in GATED else w_in.shape[2]
    if activation in GATED and w_in.shape[2] % 2:
        raise ValueError(f"moe: gated activation {activation!r} needs w_in [E, H, 2F] (gate | up), "
                         f"got an odd last dim {w_in.shape[2]}")
    if w_out.shape != (experts, f, hidden):
        raise ValueError(f"moe: expected w_out of shape {(experts, f, hidden)} [E, F, H], got {w_out.shape}")
    for name, w in (("w_in", w_in), ("w_out", w_out)):
        if not isinstance(w, Fp8Weights):
            _checks.same_dtype("moe", "x", x, name, w)
        elif not is_fp8(quantization):
            raise TypeError(f"moe: {name} is an Fp8Weights (pre-quantised weights); pass quantization='fp8_blockwise'")
    if shared_experts is not None:
        s_in, s_out = shared_experts
        fs = s_in.shape[1] // 2 if activation in GATED else s_in.shape[1]
        if s_in.ndim != 2 or s_in.shape[0] != hidden or s_out.shape != (fs, hidden):
            raise ValueError(f"moe: expected shared_experts = (w [H, 2Fs or Fs], w [Fs, H]) with H = {hidden}, got "
                             f"{s_in.shape} and {s_out.shape}")
    return tokens, hidden, experts


def _check_quantized_weights(w_in, w_out, quantized_weights, quantization):
    """quantized_weights as (Fp8Weights of w_in, of w_out), or (None, None) when not given."""
    if quantized_weights is None:
        return None, None
    if not is_fp8(quantization):
        raise TypeError("moe: quantized_weights needs an FP8 quantization ('fp8_blockwise')")
    if (not isinstance(quantized_weights, (tuple, list)) or len(quantized_weights) != 2
            or not all(isinstance(q, Fp8Weights) for q in quantized_weights)):
        raise TypeError("moe: expected quantized_weights = (Fp8Weights of w_in, Fp8Weights of w_out) "
                        f"(moe_xla.quantize_fp8_weights), got {quantized_weights!r:.200}")
    for name, w, q in (("w_in", w_in, quantized_weights[0]), ("w_out", w_out, quantized_weights[1])):
        if isinstance(w, Fp8Weights):
            raise TypeError(f"moe: {name} is an Fp8Weights and quantized_weights is given; pass the array {name} "
                            "(it gets the gradient) with its Fp8Weights in quantized_weights")
        if tuple(q.shape) != tuple(w.shape):
            raise ValueError(f"moe: expected quantized_weights' {name} of shape {tuple(w.shape)}, got {tuple(q.shape)}")
    return tuple(quantized_weights)


def _sorted_rows_fp8(x, expert_ids, num_experts: int, fp8_wgrad=False):
    """permute(x, expert_ids, num_experts, return_row_pairs=True) with quantize_fp8_rows of
    its rows, in one pass over the tokens: (x_sorted, group_sizes, row_map, row_pairs, (q,
    scales)). permute's sort alone (zero-width rows) gives group_sizes, row_map and
    row_pairs; expand_quantize_fp8_rows with the row
    map as slots and no factor (every factor 1) reads each token row once and writes its k
    sorted rows, in x's dtype and quantised (1 x 128 row tiles do not depend on the row
    order). The copy equals permute's except that entries of magnitude at most 2^-126 are
    zeros, as the quantisation sees them; x_sorted is differentiated as permute's rows in x.
    fp8_wgrad: fp8.TokenRows instead of (q, scales), so that the products quantise the
    tokens as they need them: the FP8 wgrad's column tiles of the sorted rows with their
    row tiles where a derivative is taken (gather_quantize_fp8_group_cols, which reads each
    sorted row from its token and writes no copy), the row tiles alone in a forward; x_sorted
    is then permute's rows by a plain gather that the FP8 products never read (XLA drops it
    from a jitted step)."""
    t = expert_ids.shape[0]
    _, group_sizes, row_map, row_pairs = permute(jnp.zeros((t, 0), x.dtype), expert_ids, num_experts,
                                                 return_row_pairs=True)
    token_rows = TokenRows(jax.lax.stop_gradient(x), row_map, row_pairs)
    if fp8_wgrad:
        rows, quantized = _rows.take_rows(token_rows.tokens, token_rows.sources(), x.dtype), token_rows
    else:
        rows, q, scales = token_rows.expand()
        quantized = (q, scales)
    return _permuted_rows(rows, x, expert_ids, num_experts), group_sizes, row_map, row_pairs, quantized


@functools.partial(jax.custom_jvp, nondiff_argnums=(3,))
def _permuted_rows(rows, x, expert_ids, num_experts):
    """rows, which hold permute(x, expert_ids, num_experts)'s rows, with permute's tangent in x."""
    return rows


@_permuted_rows.defjvp
def _permuted_rows_jvp(num_experts, primals, tangents):
    rows, _, expert_ids = primals
    # rows is computed from stop_gradient(x): its tangent is zero. Without a tangent of x
    # JAX does not call this rule.
    return rows, permute(tangents[1], expert_ids, num_experts)[0]


def moe(x, router_logits, w_in, w_out, *, top_k, activation="swiglu", score="softmax", bias=None, n_groups=None,
        topk_groups=None, renormalize=True, scale=1.0, shared_experts=None, return_aux=False, mesh=None,
        expert_axis=None, data_axes=None, transport="auto", dedup=True, capacity_factor=None, chunks=1,
        quantization=None, redundant_experts=None, quantized_weights=None):
    """Dropless MoE layer: y = sum_j weights_j * expert_{e_j}(x) (+ shared expert).

    x [..., H]; router_logits [..., E]; w_in [E, H, 2F] (gate | up) for gated
    activations ("swiglu", "geglu") or [E, H, F] ("gelu", "silu", "relu"); w_out [E, F, H].
    Routing options are route()'s; shared_experts = (w_in [H, 2Fs], w_out [Fs, H]) adds a
    dense expert every token passes through. Returns y [..., H] in x.dtype, and MoeAux
    when return_aux.

    Expert parallelism (moe_xla/ep/), with expert_axis (and mesh, a jax.sharding.Mesh or
    AbstractMesh, or the mesh of jax.set_mesh): experts split over mesh axis expert_axis,
    tokens over data_axes (default: the other mesh axes) and expert_axis; transport "padded"
    (all_to_all), "ragged" (ragged_all_to_all) or "auto" (padded: XLA's ragged_all_to_all
    kernel made the layer slower on an H200, benchmarks/results/LOG.md); dedup sends a token once per
    destination rank; capacity_factor sizes the exchange buffers for that multiple of the
    balanced load and sends what overflows in further rounds (still dropless); chunks
    splits each rank's tokens into independent slices so that XLA can overlap one slice's
    communication with another's grouped GEMMs. Each chunk more makes the GEMMs smaller and
    adds one full-size weight-gradient sum; on one and two H200s one chunk was the fastest
    (benchmarks/results/LOG.md), hence the default.
    redundant_experts replicates hot experts: a tuple of P tuples, the experts each rank of
    the expert axis hosts as copies of their owners' weights in up to E / P extra slots
    (moe_xla.ep.place_redundant_experts computes one from tokens_per_expert); an expert's
    tokens split among its replicas by token index, and the replicas' weight gradients
    sum into the owner's. It is static: a new placement compiles a new program.

    quantization="fp8_blockwise" runs both expert products in FP8 (moe_xla.fp8: rows in
    1 x 128 tiles, weights in 128 x 128 blocks, float32 accumulation, bf16 weight gradient;
    "fp8_blockwise_fp8_wgrad" computes the weight gradient in FP8 too, see moe_xla.fp8);
    w_in and w_out may then be moe_xla.Fp8Weights (pre-quantised, no gradient; one device),
    or arrays with quantized_weights = (quantize_fp8_weights(w_in), quantize_fp8_weights(w_out))
    made once elsewhere (e.g. once per optimizer step for several micro-batches): the
    products use those, w_in and w_out still get their gradients (one device).
    """
    tokens, hidden, experts = _check(x, router_logits, w_in, w_out, top_k, activation, shared_experts, quantization)
    quantized_weights = _check_quantized_weights(w_in, w_out, quantized_weights, quantization)
    if redundant_experts is not None and mesh is None and expert_axis is None:
        raise ValueError("moe: redundant_experts needs expert parallelism (mesh= and expert_axis=)")
    if mesh is not None or expert_axis is not None:
        if isinstance(w_in, Fp8Weights) or isinstance(w_out, Fp8Weights) or quantized_weights != (None, None):
            raise TypeError("moe: pre-quantised Fp8Weights (as w_in / w_out or quantized_weights) are not supported "
                            "with expert parallelism; pass the weights as arrays with quantization='fp8_blockwise'")
        routing = dict(score=score, n_groups=n_groups, topk_groups=topk_groups, renormalize=renormalize, scale=scale)
        return moe_ep(x, router_logits, w_in, w_out, dims=(tokens, hidden, experts), top_k=top_k,
                      activation=activation, routing=routing, bias=bias, shared_experts=shared_experts,
                      return_aux=return_aux, mesh=mesh, expert_axis=expert_axis, data_axes=data_axes,
                      transport=transport, dedup=dedup, capacity_factor=capacity_factor, chunks=chunks,
                      quantization=quantization, redundant_experts=redundant_experts)
    lead = x.shape[:-1]
    x2 = x.reshape(tokens, hidden)
    logits2 = router_logits.reshape(tokens, experts)
    with jax.named_scope("moe_xla/route"):
        weights, ids = route(logits2, top_k, score=score, bias=bias, n_groups=n_groups, topk_groups=topk_groups,
                             renormalize=renormalize, scale=scale)
    with jax.named_scope("moe_xla/dispatch"):
        x_quantized = None
        if is_fp8(quantization):
            x_sorted, group_sizes, row_map, row_pairs, x_quantized = _sorted_rows_fp8(
                x2, ids, experts, QUANTIZATION_WGRAD[quantization] == "fp8")
        elif first_product.choose(x2, w_in, top_k) == "gather":
            x_sorted, group_sizes, row_map, row_pairs = first_product.sorted_rows(x2, ids, experts)  # no copy of x
        else:
            x_sorted, group_sizes, row_map, row_pairs = permute(x2, ids, experts, return_row_pairs=True)
    y = expert_mlp(x_sorted, w_in, w_out, group_sizes, activation, quantization, x_quantized, quantized_weights,
                   combine=(row_map, weights, row_pairs))
    if shared_experts is not None:
        y = y + shared_mlp(x2, shared_experts, activation)
    y = y.reshape(lead + (hidden,))
    if not return_aux:
        return y
    with jax.named_scope("moe_xla/aux"):
        return y, router_aux(logits2, group_sizes, score, top_k)

