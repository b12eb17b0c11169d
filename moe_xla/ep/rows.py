"""The rows one rank sends: its (token, expert) pairs as rows grouped by destination rank.

Without dedup one row per (token, j), asking for one local expert. With dedup one row
per (token, destination), sent once however many of the token's experts live there; it
asks for up to mult = min(k, E_l) local experts, in j order, with their routing weights,
and the final combine adds it once (weight 1, at the first j of its destination).

Only the rows' order is computed here (permute of no columns): the transports pack each
round's rows straight from the tokens [T, H] into their send buffer (transports.pack),
so no [T*k, H] array of grouped input rows is written. (The rows coming back are put in
[T*k, H] order for unpermute without dedup or with overflow rounds: layer._round_rows.)
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from moe_xla._rows import inverse_rows
from moe_xla.ep.sizing import ExchangeSizes
from moe_xla.primitives.permute import permute


class Rows(NamedTuple):
    """The rows one rank sends, grouped by destination rank. Token t sends up to n rows
    (n = min(k, P) with dedup, else k): its (t, c), c < n, in j order."""

    dest: jax.Array     # [T, n] int32 the rank row (t, c) goes to; P: no such row (the token has fewer)
    row: jax.Array      # [T, n] int32 its place among the rows grouped by destination (permute's row_map);
    #                      where dest == P, a placeholder (j = 0's) that every use masks by dest
    lids: jax.Array     # [T*n, mult] int32 the local slots row (t, c) asks for; E_l = E / P + S: none
    w: jax.Array | None  # [T*n, mult] float32 their routing weights (dedup), else None
    source: jax.Array   # [T*k] int32 grouped row -> its (t, c) flattened (T*n: none, a row no pair sends)
    pairs: jax.Array    # [T*k] int32 number of lids < E_l of each grouped row
    counts: jax.Array   # [P] int32 rows per destination
    row_map: jax.Array  # [T*k] int32 (token, j) -> grouped row (permute's)
    combine: jax.Array  # [T, k] float32 weights of the final unpermute


def rows_by_destination(weights, dest, lid, sizes: ExchangeSizes, dedup: bool) -> Rows:
    """Rows of the pairs (t, j), of routing weights [T, k], that go to slot lid [T, k] of
    rank dest [T, k] (placement.expert_slots)."""
    t, k = dest.shape
    local, mult, peers = sizes.local_experts, sizes.mult, sizes.peers
    j = jnp.arange(k)
    if dedup:
        same = dest[:, :, None] == dest[:, None, :]                          # [T, k, k]
        first = jnp.argmax(same, axis=-1) == j                               # j is its destination's first
        # pick[t, i, c]: the c-th j (in order) that goes where j = i goes, found by its rank
        # among them (one-hot over j, no sort); there: whether that many go there.
        rank_there = jnp.cumsum(same, axis=-1, dtype=jnp.int32) - 1             # [T, k, k]
        hits = same[..., None] & (rank_there[..., None] == jnp.arange(mult))    # [T, k, k, mult]
        pick, there = jnp.argmax(hits, axis=2), jnp.any(hits, axis=2)           # [T, k, mult]
        lids = jnp.where(there, jnp.take_along_axis(jnp.broadcast_to(lid[:, None], (t, k, k)), pick, -1), local)
        w = jnp.where(there, jnp.take_along_axis(jnp.broadcast_to(weights[:, None], (t, k, k)), pick, -1), 0.0)
        row_dest, combine = jnp.where(first, dest, peers), first.astype(jnp.float32)
        # Row c of token t is its c-th first j (one-hot over j: no sort).
        n = min(k, peers)
        rank = jnp.cumsum(first, axis=-1, dtype=jnp.int32) - 1
        hit = first[:, :, None] & (rank[:, :, None] == jnp.arange(n))        # [T, k, n]
        cols, sent = jnp.argmax(hit, axis=1), jnp.any(hit, axis=1)           # [T, n]
    else:
        lids, w, row_dest, combine = lid[..., None], None, dest, weights
        n, cols, sent = k, jnp.broadcast_to(j, (t, k)), jnp.ones((t, k), bool)
    _, counts, row_map = permute(jnp.zeros((t, 0), jnp.float32), row_dest, peers)
    take = lambda a: jnp.take_along_axis(a, cols.reshape(cols.shape + (1,) * (a.ndim - 2)), axis=1)  # noqa: E731
    row = take(row_map.reshape(t, k))
    lids = take(lids).reshape(t * n, lids.shape[-1])
    w = None if w is None else take(w).reshape(t * n, mult)
    source, named = inverse_rows(jnp.where(sent, row, t * k).reshape(t * n), t * k)
    source = jnp.where(named, source, t * n)
    pairs = jnp.where(named, jnp.sum(lids < local, axis=-1, dtype=jnp.int32)[jnp.minimum(source, t * n - 1)], 0)
    return Rows(jnp.where(sent, take(row_dest), peers), row, lids, w, source, pairs, counts, row_map, combine)
