"""ep_dedup_rows: the EP layer's rows with dedup, one per (token, destination rank)
(definition in common/ep_plan.h; reference.ep_dedup_rows).

    dest [T, k], lid [T, k] int32; peers P, local L, mult M; n = min(k, P)
      -> row_dest [T, k], lids [T*n, M], weight_slot [T*k], weight_sources [T*n*M] int32
    Token t sends one row to each valid destination d in [0, P) of its pairs, at its first
    j with dest[t, j] = d: row_dest[t, j] = d there, P at every other j. Row c (t's c-th
    first j) asks for the slots lid[t, j] of t's pairs to d in j order,
    lids[t*n + c, m] = lid of the m-th (m < M), L past them. weight_slot[t*k + j] =
    (t*n + c)*M + m places pair j's routing weight among the rows' [T*n, M] weights
    (-1: an invalid destination, or m >= M); weight_sources is its inverse,
    weight_sources[(t*n + c)*M + m] = t*k + j (-1 where no pair's weight goes).

One kernel over the tokens (k^2 comparisons each, no sort) on cpu and cuda. Integer in,
integer out: nothing to differentiate.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import ad, batching

from moe_xla.primitives import _ad, _batching, _checks, _impl, _lowering, _sharding

OP = "ep_dedup_rows"

ep_dedup_rows_p = Primitive("moe_xla_ep_dedup_rows")
ep_dedup_rows_p.multiple_results = True


def ep_dedup_rows(dest, lid, *, peers: int, local: int, mult: int):
    """(row_dest [T, k], lids [T*n, mult], weight_slot [T*k], weight_sources [T*n*mult]):
    see the module docstring."""
    _checks.int_at_least(OP, "peers", peers, 1)
    _checks.int_at_least(OP, "local", local, 0)
    _checks.int_at_least(OP, "mult", mult, 1)
    return tuple(ep_dedup_rows_p.bind(dest, lid, peers=int(peers), local=int(local), mult=int(mult)))


def _abstract_eval(dest, lid, *, peers, local, mult):
    _checks.rank(OP, "dest", dest, 2, "[T, k]")
    _checks.int32(OP, "dest", dest)
    _checks.int32(OP, "lid", lid)
    if tuple(lid.shape) != tuple(dest.shape):
        raise ValueError(f"{OP}: expected lid of the shape of dest {tuple(dest.shape)}, got {tuple(lid.shape)}")
    t, k = dest.shape
    n = min(k, peers)
    if t * k >= 2**31 or t * n * mult >= 2**31:
        raise ValueError(f"{OP}: T * k = {t * k} and T * n * mult = {t * n * mult} must fit in int32")
    return [jax.core.ShapedArray((t, k), jnp.int32), jax.core.ShapedArray((t * n, mult), jnp.int32),
            jax.core.ShapedArray((t * k,), jnp.int32), jax.core.ShapedArray((t * n * mult,), jnp.int32)]


def _jvp(primals, tangents, **params):
    out = ep_dedup_rows_p.bind(*primals, **params)
    return out, [_ad.zero_tangent(o) for o in out]


def _batch(args, dims, *, peers, local, mult):
    (dest, lid), b = _batching.all_to_front(args, dims)
    _, t, k = dest.shape
    n = min(k, peers)
    row_dest, lids, slot, sources = ep_dedup_rows_p.bind(dest.reshape(b * t, k), lid.reshape(b * t, k), peers=peers,
                                                         local=local, mult=mult)
    # Batch element i's slots were counted from its first token, i * T * n rows of M in,
    # and its sources (pair entries) from i * T * k.
    slot, sources = slot.reshape(b, t * k), sources.reshape(b, t * n * mult)
    slot_offset = (jnp.arange(b, dtype=jnp.int32) * (t * n * mult))[:, None]
    source_offset = (jnp.arange(b, dtype=jnp.int32) * (t * k))[:, None]
    return [row_dest.reshape(b, t, k), lids.reshape(b, t * n, mult), jnp.where(slot >= 0, slot - slot_offset, -1),
            jnp.where(sources >= 0, sources - source_offset, -1)], [0, 0, 0, 0]


_impl.def_jitted_impl(ep_dedup_rows_p)
ep_dedup_rows_p.def_abstract_eval(_abstract_eval)
ad.primitive_jvps[ep_dedup_rows_p] = _jvp
batching.primitive_batchers[ep_dedup_rows_p] = _batch
_lowering.register(ep_dedup_rows_p, OP, lambda **params: params, sharding=_sharding.EP_DEDUP_ROWS)
