"""tgmm: the grouped product with a ragged contraction (expert weight gradients).

    out[g] = lhs[rows of g]^T @ rhs[rows of g]

lhs [M, K]; rhs [M, N]; group_sizes [G] int32 -> out [G, K, N]. Groups are consecutive
row ranges (clamped to the M rows); empty groups give zero blocks; rows past
sum(group_sizes) take no part. Accumulation is float32; the output dtype is
preferred_element_type, or lhs.dtype.

tgmm is bilinear in (lhs, rhs):
    d lhs[rows of g] = rhs[rows of g] @ ct[g]^T  = gmm(rhs, ct, transpose_rhs=True)
    d rhs[rows of g] = lhs[rows of g] @ ct[g]    = gmm(lhs, ct)
That transpose is registered in gmm.py: gmm's transpose is a tgmm, so one of the two
files holds both directions and imports the other, and the imports stay acyclic.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import ad, batching

from moe_xla.primitives import _ad, _batching, _checks, _impl, _lowering, _sharding

tgmm_p = Primitive("moe_xla_tgmm")


def tgmm(lhs, rhs, group_sizes, *, preferred_element_type=None):
    """Grouped transposed matmul: out[g] = lhs[rows of g]^T @ rhs[rows of g]."""
    out_dtype = _checks.out_dtype("tgmm", preferred_element_type, getattr(lhs, "dtype", jnp.float32))
    return tgmm_p.bind(lhs, rhs, group_sizes, preferred_element_type=out_dtype)


def _abstract_eval(lhs, rhs, group_sizes, *, preferred_element_type):
    _checks.rank("tgmm", "lhs", lhs, 2, "[M, K]")
    _checks.rank("tgmm", "rhs", rhs, 2, "[M, N]")
    _checks.float_dtype("tgmm", "lhs", lhs)
    _checks.same_dtype("tgmm", "lhs", lhs, "rhs", rhs)
    _checks.dim("tgmm", "rhs.shape[0] (M of lhs [M, K])", lhs.shape[0], rhs.shape[0])
    _checks.group_sizes("tgmm", group_sizes)
    return jax.core.ShapedArray((group_sizes.shape[0], lhs.shape[1], rhs.shape[1]), preferred_element_type)


def _batch(args, dims, *, preferred_element_type):
    (lhs, rhs, group_sizes), _ = _batching.all_to_front(args, dims)
    b, m, k = lhs.shape
    g = group_sizes.shape[1]
    out = tgmm_p.bind(lhs.reshape(b * m, k), rhs.reshape(b * m, rhs.shape[2]),
                      _batching.folded_group_sizes(group_sizes, m),
                      preferred_element_type=preferred_element_type)
    # Drop each batch element's spacer group.
    return out.reshape(b, g + 1, k, out.shape[-1])[:, :g], 0


_impl.def_jitted_impl(tgmm_p)
tgmm_p.def_abstract_eval(_abstract_eval)
ad.primitive_jvps[tgmm_p] = _ad.bilinear_jvp(tgmm_p, 0, 1)
batching.primitive_batchers[tgmm_p] = _batch
_lowering.register(tgmm_p, "tgmm", lambda **_: {}, cuda_workspace=_lowering.grouped_gemm_workspace,
                   sharding=_sharding.TGMM)
