"""gmm_unpermute: a grouped product summed back to the tokens, bilinear in its operands, as
a primitive whose transposes read the cotangent through the row map.

    a [M, F] grouped by expert, w [G, F, H], group_sizes [G] int32, token_slots [T, k]
    int32 (token t's j-th row, T * k = M; each row named at most once), src [M] int32
    (token_slots' inverse: the token of row r, outside [0, T) for rows no slot names)
    -> y [T, H] in a's dtype:
        out = gmm(a, w, group_sizes),   y[t] = sum_j out[token_slots[t, j]]
    = unpermute(gmm(a, w), token_slots, weights 1): what it lowers to.

Bilinear in (a, w). Its transposes at a cotangent ct [T, H] gather ct's rows themselves:
    d a = gather_gmm(ct, src, w, transpose_rhs=True)    d a[r] = ct[src[r]] @ w[g]^T
    d w = gather_tgmm(ct, src, a, transpose_out=True)   d w[g] = a_g^T ct[src]_g
so reverse mode never writes the gathered cotangent c[r] = ct[src[r]] ([M, H]), which
transposing unpermute and then gmm would (one pass to write c, two to read it). Rows past
sum(group_sizes) and rows no slot names get a zero d a, as through unpermute and gmm.
The tangent of moe()'s second product and combine (moe_xla/product_combine.py) is written
with it where its gathers pay (product_combine.backward_gathers).
vmap applies the formula to each batch element (no fused kernel under vmap).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from moe_xla.primitives import _ad, _checks, _impl
from moe_xla.primitives.gather_gmm import gather_gmm
from moe_xla.primitives.gather_tgmm import gather_tgmm
from moe_xla.primitives.gmm import gmm_p
from moe_xla.primitives.unpermute import unpermute_p

OP = "gmm_unpermute"

gmm_unpermute_p = Primitive("moe_xla_gmm_unpermute")


def gmm_unpermute(a, w, group_sizes, token_slots, src):
    """y[t] = sum_j gmm(a, w, group_sizes)[token_slots[t, j]]. See the module docstring."""
    return gmm_unpermute_p.bind(a, w, group_sizes, token_slots, src)


def _abstract_eval(a, w, group_sizes, token_slots, src):
    _checks.rank(OP, "a", a, 2, "[M, F]")
    _checks.rank(OP, "w", w, 3, "[G, F, H]")
    _checks.float_dtype(OP, "a", a)
    _checks.same_dtype(OP, "a", a, "w", w)
    _checks.dim(OP, "w.shape[1] (F of a [M, F])", a.shape[1], w.shape[1])
    _checks.group_sizes(OP, group_sizes, w.shape[0])
    _checks.rank(OP, "token_slots", token_slots, 2, "[T, k]")
    _checks.rank(OP, "src", src, 1, "[M]")
    for name, x in (("token_slots", token_slots), ("src", src)):
        _checks.int32(OP, name, x)
    _checks.dim(OP, "src.shape[0] (M of a [M, F])", a.shape[0], src.shape[0])
    _checks.dim(OP, "token_slots.shape[0] * token_slots.shape[1] (M of a [M, F])", a.shape[0],
                token_slots.shape[0] * token_slots.shape[1])
    return jax.core.ShapedArray((token_slots.shape[0], w.shape[2]), a.dtype)


def _formula(a, w, group_sizes, token_slots, src):
    """unpermute(gmm(a, w), token_slots, 1): the contract from other primitives."""
    out = gmm_p.bind(a, w, group_sizes, transpose_rhs=False, preferred_element_type=jnp.dtype(a.dtype))
    return unpermute_p.bind(out, token_slots.reshape(-1), unique_rows=True, has_row_pairs=False,
                            unit_k=token_slots.shape[1])


def _transpose(ct, a, w, group_sizes, token_slots, src):
    if any(ad.is_undefined_primal(x) for x in (group_sizes, token_slots, src)):
        raise ValueError(f"{OP}: group_sizes, token_slots and src are integers and cannot be differentiated")
    if ad.is_undefined_primal(a) and ad.is_undefined_primal(w):
        raise ValueError(f"{OP}: bilinear in (a, w); transposed in one of them at a time")
    none = (None, None, None)
    if ad.is_undefined_primal(a):
        if type(ct) is ad.Zero:
            return (ad.Zero(a.aval), None, *none)
        d_a = gather_gmm(ct.astype(w.dtype), src, w, group_sizes, transpose_rhs=True,
                         preferred_element_type=jnp.dtype(a.aval.dtype))
        return (d_a, None, *none)
    if type(ct) is ad.Zero:
        return (None, ad.Zero(w.aval), *none)
    d_w = gather_tgmm(ct.astype(a.dtype), src, a, group_sizes, transpose_out=True,
                      preferred_element_type=jnp.dtype(w.aval.dtype))
    return (None, d_w, *none)


def _batch(args, dims):
    return jax.vmap(_formula, in_axes=dims)(*args), 0


_impl.def_jitted_impl(gmm_unpermute_p)
gmm_unpermute_p.def_abstract_eval(_abstract_eval)
ad.primitive_jvps[gmm_unpermute_p] = _ad.bilinear_jvp(gmm_unpermute_p, 0, 1)
ad.primitive_transposes[gmm_unpermute_p] = _transpose
batching.primitive_batchers[gmm_unpermute_p] = _batch
mlir.register_lowering(gmm_unpermute_p, mlir.lower_fun(_formula, multiple_results=False))
