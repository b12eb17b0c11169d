"""gmm: the grouped matrix product of MoE experts.

    out[rows of g] = lhs[rows of g] @ rhs[g]        (rhs[g]^T with transpose_rhs)

lhs [M, K]; rhs [G, K, N], or [G, N, K] with transpose_rhs; group_sizes [G] int32.
Rows are split into consecutive groups by group_sizes (clamped to the M rows); rows past
sum(group_sizes) are zero. Accumulation is float32; the output dtype is
preferred_element_type, or lhs.dtype.

gmm is bilinear in (lhs, rhs):
    d lhs = gmm(ct, rhs, transpose_rhs = not transpose_rhs)
    d rhs = tgmm(lhs, ct)    (tgmm(ct, lhs) with transpose_rhs)
tgmm's transpose, two gmms (see tgmm.py), is registered here too, so that tgmm.py need
not import this module.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import ad, batching

from moe_xla.primitives import _ad, _batching, _checks, _impl, _lowering, _sharding
from moe_xla.primitives import tgmm as tgmm_lib

gmm_p = Primitive("moe_xla_gmm")


def gmm(lhs, rhs, group_sizes, *, transpose_rhs=False, preferred_element_type=None):
    """Grouped matmul: out[rows of g] = lhs[rows of g] @ rhs[g]. See the module docstring."""
    transpose_rhs = _checks.static_bool("gmm", "transpose_rhs", transpose_rhs)
    out_dtype = _checks.out_dtype("gmm", preferred_element_type, getattr(lhs, "dtype", jnp.float32))
    return gmm_p.bind(lhs, rhs, group_sizes, transpose_rhs=transpose_rhs, preferred_element_type=out_dtype)


def _abstract_eval(lhs, rhs, group_sizes, *, transpose_rhs, preferred_element_type):
    _checks.rank("gmm", "lhs", lhs, 2, "[M, K]")
    _checks.rank("gmm", "rhs", rhs, 3, "[G, N, K]" if transpose_rhs else "[G, K, N]")
    _checks.float_dtype("gmm", "lhs", lhs)
    _checks.same_dtype("gmm", "lhs", lhs, "rhs", rhs)
    k_axis = 2 if transpose_rhs else 1
    _checks.dim("gmm", f"rhs.shape[{k_axis}] (K of lhs [M, K])", lhs.shape[1], rhs.shape[k_axis])
    _checks.group_sizes("gmm", group_sizes, rhs.shape[0])
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    return jax.core.ShapedArray((lhs.shape[0], n), preferred_element_type)


def _transpose(ct, lhs, rhs, group_sizes, *, transpose_rhs, preferred_element_type):
    if ad.is_undefined_primal(group_sizes):
        raise ValueError("gmm: group_sizes are integers and cannot be differentiated")
    if ad.is_undefined_primal(lhs):
        if type(ct) is ad.Zero:
            return ad.Zero(lhs.aval), None, None
        d_lhs = gmm_p.bind(ct.astype(rhs.dtype), rhs, group_sizes, transpose_rhs=not transpose_rhs,
                           preferred_element_type=jnp.dtype(lhs.aval.dtype))
        return d_lhs, None, None
    if type(ct) is ad.Zero:
        return None, ad.Zero(rhs.aval), None
    ct = ct.astype(lhs.dtype)
    a, b = (ct, lhs) if transpose_rhs else (lhs, ct)
    d_rhs = tgmm_lib.tgmm_p.bind(a, b, group_sizes,
                                 preferred_element_type=jnp.dtype(rhs.aval.dtype))
    return None, d_rhs, None


def _tgmm_transpose(ct, lhs, rhs, group_sizes, *, preferred_element_type):
    if ad.is_undefined_primal(group_sizes):
        raise ValueError("tgmm: group_sizes are integers and cannot be differentiated")
    if ad.is_undefined_primal(lhs):
        if type(ct) is ad.Zero:
            return ad.Zero(lhs.aval), None, None
        d_lhs = gmm_p.bind(rhs, ct.astype(rhs.dtype), group_sizes, transpose_rhs=True,
                           preferred_element_type=jnp.dtype(lhs.aval.dtype))
        return d_lhs, None, None
    if type(ct) is ad.Zero:
        return None, ad.Zero(rhs.aval), None
    d_rhs = gmm_p.bind(lhs, ct.astype(lhs.dtype), group_sizes, transpose_rhs=False,
                       preferred_element_type=jnp.dtype(rhs.aval.dtype))
    return None, d_rhs, None


def _batch(args, dims, *, transpose_rhs, preferred_element_type):
    (lhs, rhs, group_sizes), _ = _batching.all_to_front(args, dims)
    b, m, k = lhs.shape
    # Each batch element gets one extra all-zero expert for its spacer group, whose rows
    # (past the element's groups) are then set to exactly 0.
    folded = _batching.folded_group_sizes(group_sizes, m)
    out = gmm_p.bind(lhs.reshape(b * m, k), _batching.with_spacer_groups(rhs), folded,
                     transpose_rhs=transpose_rhs, preferred_element_type=preferred_element_type)
    return _batching.zero_spacer_rows(out, folded, b, m), 0


_impl.def_jitted_impl(gmm_p)
gmm_p.def_abstract_eval(_abstract_eval)
ad.primitive_jvps[gmm_p] = _ad.bilinear_jvp(gmm_p, 0, 1)
ad.primitive_transposes[gmm_p] = _transpose
ad.primitive_transposes[tgmm_lib.tgmm_p] = _tgmm_transpose
batching.primitive_batchers[gmm_p] = _batch
_lowering.register(gmm_p, "gmm", lambda transpose_rhs, **_: {"transpose_rhs": transpose_rhs},
                   cuda_workspace=_lowering.grouped_gemm_workspace,
                   sharding=_sharding.GMM)
