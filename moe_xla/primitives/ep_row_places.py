"""ep_row_places: where the EP layer's rows sit among the rows grouped by destination
(definition in common/ep_plan.h; reference.ep_row_places).

    row_dest [T, k], row_map [T*k], lids [T*n, M] int32; peers P, local L, rows_per_token n
      -> dest_rows [T, n], row [T, n], source [T*k], pairs [T*k] int32
    Row c < n of token t is its c-th j with a valid row_dest[t, j] in [0, P) (j_c);
    row_map is permute's of row_dest over P experts (with dedup, row_dest from
    ep_dedup_rows; without, dest itself with lids [T*k, 1]).
    dest_rows[t, c] = row_dest[t, j_c]; row[t, c] = row_map[t*k + j_c], its place among
    the grouped rows (T*k if outside [0, T*k)); P and T*k where t has fewer rows.
    source[row[t, c]] = t*n + c and pairs[row[t, c]] = #{m : 0 <= lids[t*n + c, m] < L}:
    each grouped row's sender and the pairs it carries; T*n and 0 at rows no row names.

A fill and one kernel over the tokens on cpu and cuda (no scatter through XLA). Integer
in, integer out: nothing to differentiate.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import ad, batching

from moe_xla.primitives import _ad, _batching, _checks, _impl, _lowering, _sharding

OP = "ep_row_places"

ep_row_places_p = Primitive("moe_xla_ep_row_places")
ep_row_places_p.multiple_results = True


def ep_row_places(row_dest, row_map, lids, *, peers: int, local: int, rows_per_token: int):
    """(dest_rows [T, n], row [T, n], source [T*k], pairs [T*k]): see the module docstring."""
    _checks.int_at_least(OP, "peers", peers, 1)
    _checks.int_at_least(OP, "local", local, 0)
    _checks.int_at_least(OP, "rows_per_token", rows_per_token, 0)
    return tuple(ep_row_places_p.bind(row_dest, row_map, lids, peers=int(peers), local=int(local),
                                      rows_per_token=int(rows_per_token)))


def _abstract_eval(row_dest, row_map, lids, *, peers, local, rows_per_token):
    _checks.rank(OP, "row_dest", row_dest, 2, "[T, k]")
    _checks.rank(OP, "row_map", row_map, 1, "[T*k]")
    _checks.rank(OP, "lids", lids, 2, "[T*n, mult]")
    for name, x in (("row_dest", row_dest), ("row_map", row_map), ("lids", lids)):
        _checks.int32(OP, name, x)
    t, k = row_dest.shape
    n, mult = rows_per_token, lids.shape[1]
    if n > k:
        raise ValueError(f"{OP}: expected rows_per_token <= k = {k}, got {n}")
    if mult < 1:
        raise ValueError(f"{OP}: expected lids [T*n, mult] with mult >= 1, got shape {tuple(lids.shape)}")
    _checks.dim(OP, "row_map.shape[0] (T*k of row_dest [T, k])", t * k, row_map.shape[0])
    _checks.dim(OP, "lids.shape[0] (T*n, n = rows_per_token)", t * n, lids.shape[0])
    if t * k >= 2**31 or t * n * mult >= 2**31:
        raise ValueError(f"{OP}: T * k = {t * k} and T * n * mult = {t * n * mult} must fit in int32")
    pair = jax.core.ShapedArray((t, n), jnp.int32)
    rows = jax.core.ShapedArray((t * k,), jnp.int32)
    return [pair, pair, rows, rows]


def _jvp(primals, tangents, **params):
    out = ep_row_places_p.bind(*primals, **params)
    return out, [_ad.zero_tangent(o) for o in out]


def _batch(args, dims, *, peers, local, rows_per_token):
    (row_dest, row_map, lids), b = _batching.all_to_front(args, dims)
    _, t, k = row_dest.shape
    n, rows = rows_per_token, t * k
    # Batch element i's grouped rows are rows [i T k, (i+1) T k) of the folded call (entries
    # naming none go past them all), its tokens [i T, (i+1) T).
    dest_rows, row, source, pairs = ep_row_places_p.bind(
        row_dest.reshape(b * t, k), _batching.folded_rows(row_map, rows).reshape(b * rows),
        lids.reshape(b * t * n, lids.shape[-1]), peers=peers, local=local, rows_per_token=n)
    i = jnp.arange(b, dtype=jnp.int32)[:, None]
    row = row.reshape(b, t * n)
    source = source.reshape(b, rows)
    return [dest_rows.reshape(b, t, n), jnp.where(row == b * rows, rows, row - i * rows).reshape(b, t, n),
            jnp.where(source == b * t * n, t * n, source - i * (t * n)), pairs.reshape(b, rows)], [0, 0, 0, 0]


_impl.def_jitted_impl(ep_row_places_p)
ep_row_places_p.def_abstract_eval(_abstract_eval)
ad.primitive_jvps[ep_row_places_p] = _jvp
batching.primitive_batchers[ep_row_places_p] = _batch
_lowering.register(ep_row_places_p, OP, lambda **params: params, sharding=_sharding.EP_ROW_PLACES)
