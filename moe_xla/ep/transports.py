"""Transports: how a chunk's rows travel to their ranks over the expert axis, and back.

Round r sends the rows grouped by destination [starts[r, d], starts[r+1, d]) to rank d,
into a [block] slab of its receive buffer [P*block, ...] (slab s from rank s); the
results return into the places their rows left. Both transports move the same rows
between the same places:
  padded  jax.lax.all_to_all of one [block] slab per peer; unused slots hold a fill
          (zero rows asking for no expert, which every grouped GEMM skips).
  ragged  jax.lax.ragged_all_to_all: only the round's rows travel, into slab `rank` of
          d's receive buffer; the return writes them back at the sender's starts, which
          every peer learns once per chunk. Where XLA has no ragged_all_to_all (XLA:CPU)
          the same offsets drive ragged_all_to_all_by_all_to_all, a stand-in with its
          exact semantics, which is also the ragged transport's test double.
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp

from moe_xla.ep.config import EpConfig
from moe_xla.primitives.ep_gather_sum import gather_sum_p


def _slabs(rows, starts, sizes, block: int, fill):
    """[P*block, ...]: slab d holds rows [starts[d], starts[d] + sizes[d]), then `fill`.

    The ranges of different d do not overlap (rows grouped by destination), so each row
    lands in at most one slot. Float rows with fill 0 go through ep_gather_sum with one
    slot per output row and weight 1 (exact in any dtype): its transpose is ep_expand, one
    gather through the inverse of the slots, where a gather's own transpose would be a
    scatter-add over the rows."""
    pos = jnp.arange(block, dtype=jnp.int32)
    valid = (pos < sizes[:, None]).reshape(-1)
    if rows.ndim == 2 and jnp.issubdtype(rows.dtype, jnp.inexact) and fill == 0:
        # Slots past a slab's rows name no row (each a place of its own past the rows).
        past = rows.shape[0] + jnp.arange(valid.shape[0], dtype=jnp.int32)
        slots = jnp.where(valid, (starts[:, None] + pos).reshape(-1), past)[:, None]
        return gather_sum_p.bind(rows, slots, jnp.ones(slots.shape, jnp.float32))
    idx = jnp.clip(starts[:, None] + pos, 0, rows.shape[0] - 1).reshape(-1)
    return jnp.where(valid.reshape((-1,) + (1,) * (rows.ndim - 1)), rows[idx], jnp.asarray(fill, rows.dtype))


def _unslab(out, slabs, starts, sizes, block: int):
    """out with rows [starts[d], starts[d] + sizes[d]) replaced by the head of slab d."""
    pos = jnp.arange(block, dtype=jnp.int32)
    peers = starts.shape[0]
    beyond = out.shape[0] + jnp.arange(peers * block, dtype=jnp.int32).reshape(peers, block)  # distinct, dropped
    idx = jnp.where(pos < sizes[:, None], starts[:, None] + pos, beyond).reshape(-1)
    return out.at[idx].set(slabs, mode="drop", unique_indices=True)


def ragged_all_to_all_by_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *,
                                    axis_name, block):
    """jax.lax.ragged_all_to_all (one slice per peer, send sizes <= block) from all_to_all:
    slice d of operand travels in a [block] slab to peer d, which writes its head into
    output at the offset output_offsets[d] the sender chose."""
    slabs = jax.lax.all_to_all(_slabs(operand, input_offsets, send_sizes, block, 0), axis_name, 0, 0, tiled=True)
    at = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)
    return _unslab(output, slabs, at, recv_sizes, block)


class LinkArrays(NamedTuple):
    """The arrays a chunk's transport is built from (link_arrays)."""

    starts: jax.Array             # [R+1, P] int32: round r sends rows [starts[r, d], starts[r+1, d]) to d
    theirs: jax.Array | None      # ragged: [P, R+1] int32, peer s's starts for this rank; padded: None


def link_arrays(cfg: EpConfig, starts) -> LinkArrays:
    """LinkArrays of a chunk whose rounds start at `starts` [R+1, P] (the ragged transport
    exchanges them over the expert axis once)."""
    if cfg.transport == "padded":
        return LinkArrays(starts, None)
    return LinkArrays(starts, jax.lax.all_to_all(starts.T, cfg.axis, 0, 0, tiled=True))


def link(cfg: EpConfig, block: int, arrays: LinkArrays):
    """The chunk's transport, with [block]-row slabs."""
    if cfg.transport == "padded":
        return Padded(cfg.axis, block, arrays.starts)
    return Ragged(cfg.axis, block, arrays.starts, cfg.native_ragged, arrays.theirs)


class Link:
    """A chunk's transport over `axis` (see the module docstring).

    send(rows, fill, r): round r of the grouped rows [T*k, ...] -> the receive buffer
        (slab s from rank s; unused slots hold `fill`).
    back(y, r, num_rows): results [P*block, H] of round r -> [num_rows, H], each at the
        place its row left on its sender, 0 elsewhere.
    """

    def __init__(self, axis, block, starts):
        self.axis, self.block, self.starts = axis, block, starts

    def _sent(self, r):
        return self.starts[r], self.starts[r + 1] - self.starts[r]


class Padded(Link):
    """all_to_all of one [block] slab per peer and round."""

    def send(self, rows, fill, r):
        return jax.lax.all_to_all(_slabs(rows, *self._sent(r), self.block, fill), self.axis, 0, 0, tiled=True)

    def back(self, y, r, num_rows):
        slabs = jax.lax.all_to_all(y, self.axis, 0, 0, tiled=True)
        return _unslab(jnp.zeros((num_rows,) + y.shape[1:], y.dtype), slabs, *self._sent(r), self.block)


class Ragged(Link):
    """ragged_all_to_all (or its stand-in where the platform has none): only the rows of
    the round travel."""

    def __init__(self, axis, block, starts, native: bool, theirs):
        super().__init__(axis, block, starts)
        peers = starts.shape[1]
        self.collective = partial(jax.lax.ragged_all_to_all, axis_name=axis) if native else \
            partial(ragged_all_to_all_by_all_to_all, axis_name=axis, block=block)
        self.theirs = theirs  # [P, R+1]: peer s's starts for this rank
        self.mine = jnp.full((peers,), jax.lax.axis_index(axis) * block, jnp.int32)  # my slab on every peer
        self.slabs = jnp.arange(peers, dtype=jnp.int32) * block

    def _received(self, r):
        return self.theirs[:, r + 1] - self.theirs[:, r]

    def send(self, rows, fill, r):
        out = jnp.full((self.slabs.shape[0] * self.block,) + rows.shape[1:], fill, rows.dtype)
        return self.collective(rows, out, *self._sent(r), self.mine, self._received(r))

    def back(self, y, r, num_rows):
        out = jnp.zeros((num_rows,) + y.shape[1:], y.dtype)
        return self.collective(y, out, self.slabs, self._received(r), self.theirs[:, r], self._sent(r)[1])
