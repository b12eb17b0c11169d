"""route: top-k expert selection of a MoE router (definition in common/routing.h).

    source = softmax(logits) | sigmoid(logits);  select = source (+ bias with sigmoid)
    expert_ids[t] = the top_k experts by select (group-limited first when n_groups > 1),
                    descending, ties to the lower index; always in [0, E)
    weights[t, j] = source[t, expert_ids[t, j]] (/ sum_j when renormalize) * scale

logits [T, E] (float32/bfloat16/float16) -> (weights [T, k] float32, expert_ids [T, k] int32).
Selection is piecewise constant; weights are differentiable in logits for the selected
experts: the JVP is route_tangent for the saved selection, whose transpose route_grad is
a kernel (primitives/route_grad.py has the formulas). bias moves selection only and gets
no gradient.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import ad, batching

from moe_xla.primitives import _ad, _batching, _checks, _impl, _lowering, _sharding
from moe_xla.primitives.route_grad import SCORES, route_tangent

route_p = Primitive("moe_xla_route")
route_p.multiple_results = True


def route(logits, top_k, *, score="softmax", bias=None, n_groups=None, topk_groups=None, renormalize=True,
          scale=1.0):
    """Picks top_k experts per token. See the module docstring."""
    if score not in SCORES:
        raise ValueError(f"route: expected score in {SCORES}, got {score!r}")
    if bias is not None and score != "sigmoid":
        raise ValueError("route: bias (selection bias) is only defined with score='sigmoid'")
    num_experts = logits.shape[-1] if hasattr(logits, "shape") and len(logits.shape) else 0
    if (n_groups is None) != (topk_groups is None):
        raise ValueError(f"route: n_groups and topk_groups go together, got n_groups={n_groups}, "
                         f"topk_groups={topk_groups}")
    n_groups, topk_groups = (1, 1) if n_groups is None else (int(n_groups), int(topk_groups))
    if n_groups < 1 or num_experts % n_groups:
        raise ValueError(f"route: expected n_groups to divide the {num_experts} experts, got {n_groups}")
    if not 1 <= topk_groups <= n_groups:
        raise ValueError(f"route: expected 1 <= topk_groups <= n_groups = {n_groups}, got {topk_groups}")
    if not isinstance(top_k, (int, np.integer)) or not 1 <= top_k <= num_experts:
        raise ValueError(f"route: expected an int top_k in [1, {num_experts}] (E), got {top_k!r}")
    if n_groups > 1 and topk_groups * (num_experts // n_groups) < top_k:
        raise ValueError(f"route: top_k = {top_k} needs more than the {topk_groups * (num_experts // n_groups)} "
                         f"experts in topk_groups = {topk_groups} groups of {num_experts // n_groups}")
    # Without a bias the call has no bias operand (no array of zeros to fill).
    biases = () if bias is None else (bias,)
    return tuple(route_p.bind(logits, *biases, top_k=int(top_k), score=score, n_groups=n_groups,
                              topk_groups=topk_groups, renormalize=bool(renormalize), scale=float(scale),
                              has_bias=bool(biases)))


def _abstract_eval(logits, *bias, top_k, score, n_groups, topk_groups, renormalize, scale, has_bias):
    _checks.rank("route", "logits", logits, 2, "[T, E]")
    _checks.float_dtype("route", "logits", logits)
    for b in bias:
        if tuple(b.shape) != (logits.shape[1],) or jnp.dtype(b.dtype) != jnp.float32:
            raise ValueError(f"route: expected bias of shape ({logits.shape[1]},) float32, "
                             f"got {tuple(b.shape)} {b.dtype}")
    t = logits.shape[0]
    return [jax.core.ShapedArray((t, top_k), jnp.float32), jax.core.ShapedArray((t, top_k), jnp.int32)]


def _jvp(primals, tangents, **params):
    logits = primals[0]
    d_logits = tangents[0]
    weights, ids = route_p.bind(*primals, **params)
    if type(d_logits) is ad.Zero:
        d_weights = _ad.zero_tangent(weights)
    else:
        d_weights = route_tangent(logits, ids, d_logits, score=params["score"], renormalize=params["renormalize"],
                                  scale=params["scale"])
    return (weights, ids), (d_weights, _ad.zero_tangent(ids))


def _batch(args, dims, **params):
    logits, *bias = args
    l_dim, *b_dim = dims
    if any(d is not None for d in b_dim):  # a per-batch bias: one call per batch element
        out = jax.lax.map(lambda lb: tuple(route_p.bind(*lb, **params)), tuple(_batching.all_to_front(args, dims)[0]))
        return list(out), [0, 0]
    logits = jnp.moveaxis(logits, l_dim, 0)
    b, t, e = logits.shape
    weights, ids = route_p.bind(logits.reshape(b * t, e), *bias, **params)
    top_k = params["top_k"]
    return [weights.reshape(b, t, top_k), ids.reshape(b, t, top_k)], [0, 0]


def _attributes(*, top_k, score, n_groups, topk_groups, renormalize, scale, has_bias):
    return dict(top_k=top_k, score=SCORES.index(score), n_groups=n_groups, topk_groups=topk_groups,
                renormalize=renormalize, scale=np.float32(scale))


_impl.def_jitted_impl(route_p)
route_p.def_abstract_eval(_abstract_eval)
ad.primitive_jvps[route_p] = _jvp
batching.primitive_batchers[route_p] = _batch
_lowering.register(route_p, "route", _attributes, sharding=_sharding.ROUTE)
