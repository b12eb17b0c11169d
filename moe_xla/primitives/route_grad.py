"""route's weights derivative as one linear pair: route_tangent (the JVP in logits) and
its transpose route_grad (the vector-Jacobian product, definition in common/routing.h).

For fixed expert_ids, with p = softmax(logits) | sigmoid(logits) and w_j = p[ids_j]:
    route_tangent(logits, ids, d logits) = d weights:
        softmax: d w_j = w_j (d logits[ids_j] - sum_e p_e d logits_e)
        sigmoid: d w_j = w_j (1 - w_j) d logits[ids_j]
        renormalize (S = sum_j w_j > 0): d (w_j / S) = (d w_j - (w_j / S) sum_i d w_i) / S
        scale: times scale.
    route_grad(logits, ids, g) = d logits, its transpose in d logits: with u = R^T (scale g)
    (R the renormalisation above, u = scale g without it),
        softmax: d logits_e = sum_{j: ids_j = e} w_j u_j - p_e sum_j w_j u_j
        sigmoid: d logits_e = sum_{j: ids_j = e} w_j (1 - w_j) u_j.

route's JVP is route_tangent, so reverse mode runs route_grad: one kernel per token row
(cpu and cuda) instead of the softmax, gathers and scatter-add of a jnp derivative. Each
is linear in its last operand and nonlinear in logits; route_tangent evaluates in jnp
(forward mode only); derivatives in logits (second order) come from jnp.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from moe_xla.primitives import _ad, _batching, _checks, _impl, _lowering, _sharding

OP = "route_grad"
SCORES = ("softmax", "sigmoid")  # the FFI attribute `score` is the index in this tuple

route_tangent_p = Primitive("moe_xla_route_tangent")
route_grad_p = Primitive("moe_xla_route_grad")


def route_tangent(logits, expert_ids, d_logits, *, score: str, renormalize: bool, scale: float):
    """d weights [T, k] float32 for d logits [T, E] (module docstring)."""
    return route_tangent_p.bind(logits, expert_ids, d_logits, score=score, renormalize=bool(renormalize),
                                scale=float(scale))


def route_grad(logits, expert_ids, d_weights, *, score: str, renormalize: bool, scale: float):
    """d logits [T, E] in logits' dtype for the cotangent d_weights [T, k] (module docstring)."""
    return route_grad_p.bind(logits, expert_ids, d_weights, score=score, renormalize=bool(renormalize),
                             scale=float(scale))


def _check(name, logits, expert_ids, last, last_name, last_shape):
    _checks.rank(name, "logits", logits, 2, "[T, E]")
    _checks.float_dtype(name, "logits", logits)
    _checks.rank(name, "expert_ids", expert_ids, 2, "[T, k]")
    _checks.int32(name, "expert_ids", expert_ids)
    _checks.dim(name, "expert_ids.shape[0] (T of logits [T, E])", logits.shape[0], expert_ids.shape[0])
    if tuple(last.shape) != last_shape:
        raise ValueError(f"{name}: expected {last_name} of shape {last_shape}, got {tuple(last.shape)}")


def _tangent_abstract_eval(logits, expert_ids, d_logits, **_):
    _check("route_tangent", logits, expert_ids, d_logits, "d_logits", tuple(logits.shape))
    return jax.core.ShapedArray(expert_ids.shape, jnp.float32)


def _grad_abstract_eval(logits, expert_ids, d_weights, **_):
    _check(OP, logits, expert_ids, d_weights, "d_weights", tuple(expert_ids.shape))
    if jnp.dtype(d_weights.dtype) != jnp.float32:
        raise TypeError(f"{OP}: expected float32 d_weights, got {d_weights.dtype}")
    return jax.core.ShapedArray(logits.shape, logits.dtype)


def _tangent(logits, expert_ids, d_logits, *, score, renormalize, scale):
    """route_tangent in jnp (module docstring); ids outside [0, E) pick nothing."""
    x, dx = logits.astype(jnp.float32), d_logits.astype(jnp.float32)
    valid = (expert_ids >= 0) & (expert_ids < x.shape[-1])
    safe = jnp.where(valid, expert_ids, 0)
    p = jax.nn.softmax(x, axis=-1) if score == "softmax" else jax.nn.sigmoid(x)
    w = jnp.where(valid, jnp.take_along_axis(p, safe, axis=-1), 0.0)
    dx_picked = jnp.take_along_axis(dx, safe, axis=-1)
    if score == "softmax":
        dw = w * (dx_picked - jnp.sum(p * dx, axis=-1, keepdims=True))
    else:
        dw = w * (1.0 - w) * dx_picked
    if renormalize:
        total = jnp.sum(w, axis=-1, keepdims=True)
        positive = total > 0
        total = jnp.where(positive, total, 1.0)
        dw = jnp.where(positive, (dw - w / total * jnp.sum(dw, axis=-1, keepdims=True)) / total, dw)
    return dw * jnp.float32(scale)


def _grad_jnp(logits, expert_ids, d_weights, **params):
    """route_grad in jnp, the transpose of _tangent: for derivatives in logits."""
    transpose = jax.linear_transpose(lambda dx: _tangent(logits, expert_ids, dx, **params), logits)
    return transpose(d_weights)[0]


def _pair_jvp(prim, formula):
    """JVP rule of a pair member: linear in its last operand (the member itself), and in
    logits the JVP of its jnp `formula`."""

    def jvp(primals, tangents, **params):
        out = prim.bind(*primals, **params)
        t_logits, _, t_last = tangents
        if type(t_logits) is ad.Zero:
            return out, (_ad.zero_tangent(out) if type(t_last) is ad.Zero else prim.bind(
                primals[0], primals[1], t_last, **params))
        f = lambda x, last: formula(x, primals[1], last, **params)  # noqa: E731
        return out, jax.jvp(f, (primals[0], primals[2]), (t_logits, ad.instantiate_zeros(t_last)))[1]

    return jvp


def _linear_transpose(other):
    """Transpose rule of a pair member in its last operand: the other member."""

    def transpose(ct, logits, expert_ids, last, **params):
        if ad.is_undefined_primal(logits) or ad.is_undefined_primal(expert_ids):
            raise ValueError("route_grad: the pair is linear in its last operand only")
        if type(ct) is ad.Zero:
            return None, None, ad.Zero(last.aval)
        return None, None, other.bind(logits, expert_ids, ct, **params).astype(last.aval.dtype)

    return transpose


def _batch(prim):
    """Tokens are independent: the batch folds into T."""

    def batch(args, dims, **params):
        (logits, ids, last), b = _batching.all_to_front(args, dims)
        t = logits.shape[1]
        out = prim.bind(logits.reshape((b * t,) + logits.shape[2:]), ids.reshape((b * t,) + ids.shape[2:]),
                        last.reshape((b * t,) + last.shape[2:]), **params)
        return out.reshape((b, t) + out.shape[1:]), 0

    return batch


def _attributes(*, score, renormalize, scale):
    return dict(score=SCORES.index(score), renormalize=renormalize, scale=np.float32(scale))


route_tangent_p.def_impl(_tangent)
route_tangent_p.def_abstract_eval(_tangent_abstract_eval)
ad.primitive_jvps[route_tangent_p] = _pair_jvp(route_tangent_p, _tangent)
ad.primitive_transposes[route_tangent_p] = _linear_transpose(route_grad_p)
batching.primitive_batchers[route_tangent_p] = _batch(route_tangent_p)
mlir.register_lowering(route_tangent_p, mlir.lower_fun(_tangent, multiple_results=False))

_impl.def_jitted_impl(route_grad_p)
route_grad_p.def_abstract_eval(_grad_abstract_eval)
ad.primitive_jvps[route_grad_p] = _pair_jvp(route_grad_p, _grad_jnp)
ad.primitive_transposes[route_grad_p] = _linear_transpose(route_tangent_p)
batching.primitive_batchers[route_grad_p] = _batch(route_grad_p)
_lowering.register(route_grad_p, OP, _attributes, sharding=_sharding.ROUTE_GRAD)
