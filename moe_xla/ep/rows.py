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

from moe_xla.ep.sizing import ExchangeSizes
from moe_xla.primitives.ep_dedup_rows import ep_dedup_rows
from moe_xla.primitives.ep_expand import expand
from moe_xla.primitives.ep_row_places import ep_row_places
from moe_xla.primitives.permute import permute


class Rows(NamedTuple):
    """The rows one rank sends, grouped by destination rank. Token t sends up to n rows
    (n = min(k, P) with dedup, else k): its (t, c), c < n, in j order."""

    dest: jax.Array     # [T, n] int32 the rank row (t, c) goes to; P: no such row (the token has fewer)
    row: jax.Array      # [T, n] int32 its place among the rows grouped by destination (T*k: none)
    lids: jax.Array     # [T*n, mult] int32 the slots row (t, c) asks for, numbered over all ranks
    #                     (placement.expert_slots); P E_l: none (E_l = E / P + S; local_slots)
    w: jax.Array | None  # [T*n, mult] float32 their routing weights (dedup), else None
    source: jax.Array   # [T*k] int32 grouped row -> its (t, c) flattened (T*n: none, a row no pair sends)
    pairs: jax.Array    # [T*k] int32 number of slots each grouped row asks for
    counts: jax.Array   # [P] int32 rows per destination
    row_map: jax.Array  # [T*k] int32 (token, j) -> grouped row (permute's)
    row_pairs: jax.Array  # [T*k] int32 grouped row -> (token, j), row_map's inverse (permute's)
    combine: jax.Array  # [T, k] float32 weights of the final unpermute


def rows_by_destination(weights, slot, sizes: ExchangeSizes, dedup: bool) -> Rows:
    """Rows of the pairs (t, j), of routing weights [T, k], that go to slot [T, k], numbered
    over all ranks (placement.expert_slots): rank dest = slot // E_l.

    Three kernels: ep_dedup_rows (with dedup) picks each token's rows, permute (no
    columns) groups them by destination, ep_row_places says where each row went. The
    rows carry their slots as numbered (the kernels copy them and fill P E_l, past every
    slot, where none): the send buffer takes their local numbers (local_slots) in the
    fusion that packs them, so no [T, k] array of local slots is written. The routing
    weights reach their rows' places by ep_expand, whose transpose is a gather: no
    scatter-add in the backward."""
    t, k = slot.shape
    mult, peers, none = sizes.mult, sizes.peers, sizes.peers * sizes.local_experts
    dest = jax.lax.div(slot, sizes.local_experts)  # slot >= 0
    if dedup:
        n = min(k, peers)
        row_dest, lids, weight_slot, weight_sources = ep_dedup_rows(dest, slot, peers=peers, local=none, mult=mult)
        w = expand(weights.reshape(t * k, 1), weight_slot.reshape(t * k, 1), num_pairs=t * n * mult,
                   sources=weight_sources)
        w, combine = w.reshape(t * n, mult), (row_dest < peers).astype(jnp.float32)
    else:
        n, row_dest, lids, w, combine = k, dest, slot.reshape(t * k, 1), None, weights
    _, counts, row_map, row_pairs = permute(jnp.zeros((t, 0), jnp.float32), row_dest, peers, return_row_pairs=True)
    dest_rows, row, source, pairs = ep_row_places(row_dest, row_map, lids, peers=peers, local=none,
                                                  rows_per_token=n)
    return Rows(dest_rows, row, lids, w, source, pairs, counts, row_map, row_pairs, combine)


def local_slots(lids, sizes: ExchangeSizes):
    """The slots on their rank of lids numbered over all ranks (Rows.lids): lids % E_l, and
    E_l (none) for P E_l (none)."""
    local = sizes.local_experts
    return jnp.where(lids < sizes.peers * local, jax.lax.rem(lids, local), local)

