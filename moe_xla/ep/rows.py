"""The rows one rank sends: its (token, expert) pairs as rows grouped by destination rank.

Without dedup one row per (token, j), asking for one local expert. With dedup one row
per (token, destination), sent once however many of the token's experts live there; it
asks for up to mult = min(k, E_l) local experts, in j order, with their routing weights,
and the final unpermute adds it once (weight 1, at the first j of its destination).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from moe_xla.ep.sizing import ExchangeSizes
from moe_xla.primitives.permute import permute


class Rows(NamedTuple):
    """The rows one rank sends, grouped by destination rank."""

    x: jax.Array        # [T*k, H] permute(x, row_dest, P): the rows of destination d, then d + 1, ...
    lids: jax.Array     # [T*k, mult] int32 the local slots each row asks for; E_l = E / P + S: none
    w: jax.Array | None  # [T*k, mult] float32 their routing weights (dedup), else None
    pairs: jax.Array    # [T*k] int32 number of lids < E_l per row
    counts: jax.Array   # [P] int32 rows per destination
    row_map: jax.Array  # [T*k] int32 (token, j) -> row (permute's)
    combine: jax.Array  # [T, k] float32 weights of the final unpermute


def rows_by_destination(x, weights, dest, lid, sizes: ExchangeSizes, dedup: bool) -> Rows:
    """Rows of tokens x [T, H] whose pairs (t, j), of routing weights [T, k], go to slot
    lid [T, k] of rank dest [T, k] (placement.expert_slots)."""
    t, k = dest.shape
    local, mult = sizes.local_experts, sizes.mult
    if dedup:
        j = jnp.arange(k)
        same = dest[:, :, None] == dest[:, None, :]                          # [T, k, k]
        first = jnp.argmax(same, axis=-1) == j                               # j is its destination's first
        pick = jnp.argsort(jnp.where(same, j, k + j), axis=-1)[..., :mult]   # that destination's j, in order
        there = jnp.take_along_axis(same, pick, axis=-1)
        lids = jnp.where(there, jnp.take_along_axis(jnp.broadcast_to(lid[:, None], (t, k, k)), pick, -1), local)
        w = jnp.where(there, jnp.take_along_axis(jnp.broadcast_to(weights[:, None], (t, k, k)), pick, -1), 0.0)
        row_dest, combine = jnp.where(first, dest, sizes.peers), first.astype(jnp.float32)
    else:
        lids, w, row_dest, combine = lid[..., None], None, dest, weights
    x_rows, counts, row_map = permute(x, row_dest, sizes.peers)

    def grouped(a):  # a [T, k, ...] per (token, j) -> the rows' order
        flat = a.reshape((t * k,) + a.shape[2:])
        return jnp.zeros_like(flat).at[row_map].set(flat, unique_indices=True)

    lids = grouped(lids)
    return Rows(x_rows, lids, None if w is None else grouped(w), jnp.sum(lids < local, axis=-1, dtype=jnp.int32),
                counts, row_map, combine)
