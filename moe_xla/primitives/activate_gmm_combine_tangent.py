"""activate_gmm_combine_tangent: the tangent of moe()'s expert activation, second product and
weighted combine (product_combine.activate_gmm_combine) as one linear primitive, whose
transpose runs the activation's backward in one pass and takes the weight gradient's rows
from it.

At the point h [M, 2F] (gated) or [M, F], omega [M] float32 (each row's routing weight),
w_out [E, F, H], group_sizes [E] int32, slots [T, k] int32 (permute's row_map reshaped:
token t's j-th row), src [M] int32 (the token of each row, outside [0, T) for none) and
row_pairs [M] int32 (permute's), along d_h (h's shape and dtype), d_omega [M] float32 and
d_w_out (w_out's shape and dtype):

    d y = combine(first(d b) + second(b, d w_out))        [T, H] in h's dtype
    b = omega * a,  d b = omega act'(h) d_h + d_omega a    (a = act(h); primitives/_activation)

first(r) = r @ w_out[e] and second(b, w) = b @ w[e] for the rows of expert e, and combine
sums each token's k rows. With `gathered`, the products are gmm_unpermute's (their sum over
the token's rows included; combine is the identity), whose transposes read the cotangent
through src; otherwise gmm's, and combine is unpermute through the row map.

Linear in (d_h, d_omega, d_w_out). Its transpose at a cotangent ct [T, H]:
    c = combine^T(ct)                                   the cotangent of each row (gathered: ct)
    g = first^T(c)                                      [M, F], one grouped GEMM
    (d h, d omega, b) = activate_weighted_grad(h, g, omega)    one pass over h and g; b in g's place
    d w_out = second(b, .)^T(c)                         one tgmm
so the backward reads h once, where transposing the formula reads it for act'(h), for
<g, a> and for b in passes of their own. d h is returned after d w_out (primitives/after):
left to itself XLA may schedule the weight gradient last, keeping b and c live beside the
first product's backward.
The evaluation at a point (forward mode), its derivatives and vmap use the formula (so
the gradient of a vmapped layer transposes the formula's ops, unfused, while the vmap of
a gradient batches the fused sequence). Where w_out is not differentiated the kernel still
writes b, into g's buffer: F columns per row more written, no memory.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from moe_xla.primitives import _checks, _impl
from moe_xla.primitives._activation import GATED, weighted, weighted_tangent
from moe_xla.primitives.activate_weighted_grad import activate_weighted_grad
from moe_xla.primitives.after import after
from moe_xla.primitives.gmm import gmm
from moe_xla.primitives.gmm_unpermute import gmm_unpermute
from moe_xla.primitives.unpermute import unpermute

OP = "activate_gmm_combine_tangent"
# Operand positions: the point, then the tangent.
_POINT, _TANGENT = range(7), range(7, 10)
_FLOAT = (0, 1, 2, 7, 8, 9)

activate_gmm_combine_tangent_p = Primitive("moe_xla_activate_gmm_combine_tangent")


def activate_gmm_combine_tangent(h, omega, w_out, group_sizes, slots, src, row_pairs, d_h, d_omega, d_w_out,
                                 activation: str, gathered: bool):
    """d y at the point (h, omega, w_out, group_sizes, slots, src, row_pairs) along (d_h,
    d_omega, d_w_out). See the module docstring."""
    return activate_gmm_combine_tangent_p.bind(h, omega, w_out, group_sizes, slots, src, row_pairs, d_h, d_omega,
                                               d_w_out, activation=activation, gathered=gathered)


def _products(w_out, group_sizes, slots, src, row_pairs, gathered: bool):
    """(first, second, combine) of the module docstring."""
    if gathered:
        return (lambda rows: gmm_unpermute(rows, w_out, group_sizes, slots, src),
                lambda b, w: gmm_unpermute(b, w, group_sizes, slots, src),
                lambda y: y)
    return (lambda rows: gmm(rows, w_out, group_sizes),
            lambda b, w: gmm(b, w, group_sizes),
            lambda out: unpermute(out, slots.reshape(-1), top_k=slots.shape[1], row_pairs=row_pairs))


def formula(h, omega, w_out, group_sizes, slots, src, row_pairs, d_h, d_omega, d_w_out, *, activation, gathered):
    """The op in jnp and the products' primitives."""
    first, second, combine = _products(w_out, group_sizes, slots, src, row_pairs, gathered)
    d_b = weighted_tangent(h, omega, d_h, d_omega, activation)
    return combine(first(d_b) + second(weighted(h, omega, activation), d_w_out))


def _abstract_eval(h, omega, w_out, group_sizes, slots, src, row_pairs, d_h, d_omega, d_w_out, *, activation,
                   gathered):
    _checks.rank(OP, "h", h, 2, "[M, 2F] or [M, F]")
    _checks.rank(OP, "w_out", w_out, 3, "[E, F, H]")
    _checks.rank(OP, "slots", slots, 2, "[T, k]")
    m, f = h.shape[0], h.shape[1] // 2 if activation in GATED else h.shape[1]
    _checks.dim(OP, "w_out.shape[1] (F of h)", f, w_out.shape[1])
    for name, x, want in (("d_h", d_h, h), ("d_w_out", d_w_out, w_out)):
        if tuple(x.shape) != tuple(want.shape) or x.dtype != want.dtype:
            raise ValueError(f"{OP}: expected {name} {want.dtype} {tuple(want.shape)}, got {x.dtype} {tuple(x.shape)}")
    for name, x in (("omega", omega), ("d_omega", d_omega)):
        if jnp.dtype(x.dtype) != jnp.float32 or tuple(x.shape) != (m,):
            raise ValueError(f"{OP}: expected {name} float32 [{m}] (M of h), got {x.dtype} {tuple(x.shape)}")
    return jax.core.ShapedArray((slots.shape[0], w_out.shape[2]), h.dtype)


def _jvp(primals, tangents, **params):
    out = activate_gmm_combine_tangent_p.bind(*primals, **params)

    def on_floats(*floats):
        args = list(primals)
        for i, x in zip(_FLOAT, floats):
            args[i] = x
        return formula(*args, **params)

    _, d_out = jax.jvp(on_floats, tuple(primals[i] for i in _FLOAT),
                       tuple(ad.instantiate_zeros(tangents[i]) for i in _FLOAT))
    return out, d_out


def _transpose(ct, *args, activation, gathered):
    if any(ad.is_undefined_primal(args[i]) for i in _POINT):
        raise ValueError(f"{OP}: linear in (d_h, d_omega, d_w_out) only; the other operands are the point")
    h, omega, w_out, group_sizes, slots, src, row_pairs = args[:7]
    wanted = [ad.is_undefined_primal(args[i]) for i in _TANGENT]
    if type(ct) is ad.Zero:
        return (None,) * 7 + tuple(ad.Zero(args[i].aval) if w else None for i, w in zip(_TANGENT, wanted))
    first, second, combine = _products(w_out, group_sizes, slots, src, row_pairs, gathered)
    f = w_out.shape[1]
    with jax.named_scope("moe_xla/combine"):
        c = ct if gathered else jax.linear_transpose(
            combine, jax.ShapeDtypeStruct((h.shape[0], w_out.shape[2]), ct.dtype))(ct)[0]
    with jax.named_scope("moe_xla/gmm_out"):
        (g,) = jax.linear_transpose(first, jax.ShapeDtypeStruct((h.shape[0], f), h.dtype))(c)
    with jax.named_scope("moe_xla/act"):
        d_h, d_omega, b = activate_weighted_grad(h, g, omega, activation)
    d_w_out = None
    if wanted[2]:
        with jax.named_scope("moe_xla/gmm_out"):
            (d_w_out,) = jax.linear_transpose(functools.partial(second, b),
                                              jax.ShapeDtypeStruct(w_out.shape, w_out.dtype))(c)
        if wanted[0]:
            with jax.named_scope("moe_xla/gmm_out"):
                d_h = after(d_h, d_w_out)
    return (None,) * 7 + (d_h if wanted[0] else None, d_omega if wanted[1] else None, d_w_out)


def _batch(args, dims, **params):
    return jax.vmap(functools.partial(formula, **params), in_axes=tuple(dims))(*args), 0


_impl.def_jitted_impl(activate_gmm_combine_tangent_p)
activate_gmm_combine_tangent_p.def_abstract_eval(_abstract_eval)
ad.primitive_jvps[activate_gmm_combine_tangent_p] = _jvp
ad.primitive_transposes[activate_gmm_combine_tangent_p] = _transpose
batching.primitive_batchers[activate_gmm_combine_tangent_p] = _batch
mlir.register_lowering(activate_gmm_combine_tangent_p, mlir.lower_fun(formula, multiple_results=False))
