"""activate_weighted_tangent: the tangent of the routing-weighted expert activation
b[r] = omega[r] * act(h[r]), as a linear primitive whose transpose is one kernel.

    h [M, 2F] or [M, F], omega [M] float32 (the point), d_h of h's shape and dtype, d_omega
    [M] float32 (the tangent) -> d b [M, F] in h's dtype:
        d b = omega * act'(h) d_h + d_omega * a,  a = act(h) rounded to h's dtype
    in float32, rounded once (primitives/_activation.weighted_tangent, which it lowers to).

Linear in (d_h, d_omega). Its transpose at a cotangent g is activate_weighted_grad(h, g,
omega): d h and d omega in one pass over h and g, where transposing the jnp formula would
take XLA's separate fusions for act(h), act'(h) and the row sums. The derivative rule of
moe()'s second product (moe_xla/product_combine.py) is written with it, so forward mode
runs the formula and reverse mode the kernel. Derivatives in (h, omega) are the formula's.
Rows are independent: it vmaps by folding the batch into M.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from moe_xla.primitives import _batching, _checks, _impl
from moe_xla.primitives._activation import GATED, weighted_tangent
from moe_xla.primitives.activate_weighted_grad import activate_weighted_grad

OP = "activate_weighted_tangent"

activate_weighted_tangent_p = Primitive("moe_xla_activate_weighted_tangent")


def activate_weighted_tangent(h, omega, d_h, d_omega, activation: str):
    """d (omega * act(h)) at (h, omega) along (d_h, d_omega). See the module docstring."""
    return activate_weighted_tangent_p.bind(h, omega, d_h, d_omega, activation=activation)


def _abstract_eval(h, omega, d_h, d_omega, *, activation):
    _checks.rank(OP, "h", h, 2, "[M, 2F] or [M, F]")
    _checks.float_dtype(OP, "h", h)
    _checks.same_dtype(OP, "h", h, "d_h", d_h)
    if tuple(d_h.shape) != tuple(h.shape):
        raise ValueError(f"{OP}: expected d_h of h's shape {tuple(h.shape)}, got {tuple(d_h.shape)}")
    m = h.shape[0]
    for name, x in (("omega", omega), ("d_omega", d_omega)):
        if jnp.dtype(x.dtype) != jnp.float32 or tuple(x.shape) != (m,):
            raise ValueError(f"{OP}: expected {name} float32 [{m}] (M of h), got {x.dtype} {tuple(x.shape)}")
    c = h.shape[1]
    if activation in GATED and c % 2:
        raise ValueError(f"{OP}: gated activation {activation!r} needs h [M, 2F] (gate | up), got an odd last dim {c}")
    return jax.core.ShapedArray((m, c // 2 if activation in GATED else c), h.dtype)


def _jvp(primals, tangents, *, activation):
    out = activate_weighted_tangent_p.bind(*primals, activation=activation)
    tangents = [ad.instantiate_zeros(t) for t in tangents]
    _, d_out = jax.jvp(lambda *args: weighted_tangent(*args, activation), tuple(primals), tuple(tangents))
    return out, d_out


def _transpose(ct, h, omega, d_h, d_omega, *, activation):
    if ad.is_undefined_primal(h) or ad.is_undefined_primal(omega):
        raise ValueError(f"{OP}: linear in (d_h, d_omega) only; h and omega are the point")
    wanted = (ad.is_undefined_primal(d_h), ad.is_undefined_primal(d_omega))
    if type(ct) is ad.Zero:
        grads = (ad.Zero(d_h.aval), ad.Zero(d_omega.aval))
    else:
        grads = activate_weighted_grad(h, ct, omega, activation)
    return (None, None, *(gr if w else None for gr, w in zip(grads, wanted)))


def _batch(args, dims, *, activation):
    args, size = _batching.all_to_front(args, dims)
    m = args[0].shape[1]
    folded = [a.reshape(size * m, *a.shape[2:]) for a in args]
    out = activate_weighted_tangent_p.bind(*folded, activation=activation)
    return out.reshape(size, m, out.shape[-1]), 0


_impl.def_jitted_impl(activate_weighted_tangent_p)
activate_weighted_tangent_p.def_abstract_eval(_abstract_eval)
ad.primitive_jvps[activate_weighted_tangent_p] = _jvp
ad.primitive_transposes[activate_weighted_tangent_p] = _transpose
batching.primitive_batchers[activate_weighted_tangent_p] = _batch
mlir.register_lowering(activate_weighted_tangent_p, mlir.lower_fun(
    lambda h, omega, d_h, d_omega, *, activation: weighted_tangent(h, omega, d_h, d_omega, activation),
    multiple_results=False))
