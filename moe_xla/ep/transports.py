"""Transports: how a chunk's rows travel to their ranks over the expert axis, and back.

Round r sends the rows grouped by destination [starts[r, d], starts[r+1, d]) to rank d.
The sender packs them straight from its tokens into a send buffer [P*block, ...] (pack:
slab d holds destination d's rows of the round, then a fill; `slots` says where the row
of each (token, j) pair sits), rank d receives them into slab s of its receive buffer
[P*block, ...] (slab s from rank s), and the results return into the sender's send
buffer layout (the same slots). Both transports move the same rows between the same
places:
  padded  jax.lax.all_to_all of one [block] slab per peer; unused slots hold a fill
          (zero rows asking for no expert, which every grouped GEMM skips).
  ragged  jax.lax.ragged_all_to_all: only the round's rows travel, from the head of
          slab d of the sender into slab `rank` of d's receive buffer, and back. Where
          XLA has no ragged_all_to_all (XLA:CPU) the same offsets drive
          ragged_all_to_all_by_all_to_all, a stand-in with its exact semantics, which is
          also the ragged transport's test double.
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp

from moe_xla._rows import inverse_rows
from moe_xla.ep.config import EpConfig
from moe_xla.primitives._checks import FLOAT_DTYPES
from moe_xla.primitives.ep_expand import expand
from moe_xla.primitives.unpermute import unpermute


def _kernel_float(values) -> bool:
    """Whether values have a dtype the row kernels take (float32, bfloat16, float16)."""
    return jnp.dtype(values.dtype) in FLOAT_DTYPES


def _slabs(rows, starts, sizes, block: int, fill):
    """[P*block, ...]: slab d holds rows [starts[d], starts[d] + sizes[d]), then `fill`.

    The ranges of different d do not overlap (rows grouped by destination), so each row
    lands in at most one slot. Rows of the kernels' float dtypes with fill 0 go through
    unpermute with one slot per output row and weight 1 (exact in any dtype): its
    transpose is one gather through the inverse of the slots, where a gather's own
    transpose would be a scatter-add over the rows."""
    pos = jnp.arange(block, dtype=jnp.int32)
    valid = (pos < sizes[:, None]).reshape(-1)
    if rows.ndim == 2 and _kernel_float(rows) and fill == 0:
        # Slots past a slab's rows name no row (each a place of its own past the rows).
        past = rows.shape[0] + jnp.arange(valid.shape[0], dtype=jnp.int32)
        slots = jnp.where(valid, (starts[:, None] + pos).reshape(-1), past)
        return unpermute(rows, slots, top_k=1, unique_rows=True)
    idx = jnp.clip(starts[:, None] + pos, 0, rows.shape[0] - 1).reshape(-1)
    return jnp.where(valid.reshape((-1,) + (1,) * (rows.ndim - 1)), rows[idx], jnp.asarray(fill, rows.dtype))


def _unslab(out, slabs, starts, sizes, block: int):
    """out with rows [starts[d], starts[d] + sizes[d]) replaced by the head of slab d."""
    pos = jnp.arange(block, dtype=jnp.int32)
    peers = starts.shape[0]
    beyond = out.shape[0] + jnp.arange(peers * block, dtype=jnp.int32).reshape(peers, block)  # distinct, dropped
    idx = jnp.where(pos < sizes[:, None], starts[:, None] + pos, beyond).reshape(-1)
    return out.at[idx].set(slabs, mode="drop", unique_indices=True)


def pack(values, slots, num_rows: int, fill=0, sources=None):
    """[num_rows, ...]: row slots[q, j] is values[q] (for every j), rows no slot names hold
    `fill`; slots [N, m] name each row at most once (outside [0, num_rows): none).
    sources: None, or the inverse of slots [num_rows] int32 (the q of each row, outside
    [0, N) for none; Link.sources), which spares computing it with a scatter.

    Values of the kernels' float dtypes with fill 0 go through ep_expand (a bitwise copy):
    its transpose is a gather and a sum in j order (unpermute), where a gather's own
    transpose would be a scatter-add over the rows."""
    if values.ndim == 2 and _kernel_float(values) and fill == 0:
        return expand(values, slots, num_pairs=num_rows, sources=sources)
    if sources is None:
        src, named = inverse_rows(slots.reshape(-1), num_rows)
        src = src // slots.shape[1]
    else:
        named = (sources >= 0) & (sources < values.shape[0])
        src = jnp.where(named, sources, 0)
    taken = values[src]
    return jnp.where(named.reshape((-1,) + (1,) * (values.ndim - 1)), taken, jnp.asarray(fill, values.dtype))


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

    slots(dest, row, r): where the rows sent to ranks dest (P: none) from their places
        `row` among the grouped rows sit in round r's send buffer [P*block] (P*block, no
        place, for a row not in round r).
    sources(source, r): the inverse of slots, by a gather.
    send(buf, fill, r): round r's send buffer [P*block, ...] (pack) -> the receive buffer
        (slab s from rank s; unused slots hold `fill`).
    back(y, r): results [P*block, H] of round r -> [P*block, H] in the send buffer's
        layout, each at the place its row left (0 at unused slots).
    """

    def __init__(self, axis, block, starts):
        self.axis, self.block, self.starts = axis, block, starts

    def _sent(self, r):
        return self.starts[r], self.starts[r + 1] - self.starts[r]

    def slots(self, dest, row, r):
        starts, sizes = self._sent(r)
        peers = starts.shape[0]
        d = jnp.clip(dest, 0, peers - 1)
        at = row - starts[d]
        inside = (dest < peers) & (at >= 0) & (at < sizes[d])
        return jnp.where(inside, d * self.block + at, peers * self.block)

    def sources(self, source, r):
        """The inverse of `slots`, a gather: [P*block] int32, for place d * block + i of
        round r's send buffer the entry of `source` (grouped row -> what sends it) at
        grouped row starts[r, d] + i, or -1 past the round's rows to d. The grouped rows
        of destination d in round r are [starts[r, d], starts[r + 1, d]), so the row at
        that place is the one slots put there."""
        starts, sizes = self._sent(r)
        pos = jnp.arange(self.block, dtype=jnp.int32)
        grouped = jnp.clip(starts[:, None] + pos, 0, source.shape[0] - 1)
        return jnp.where(pos < sizes[:, None], source[grouped], -1).reshape(-1)


class Padded(Link):
    """all_to_all of one [block] slab per peer and round."""

    def send(self, buf, fill, r):
        return jax.lax.all_to_all(buf, self.axis, 0, 0, tiled=True)

    def back(self, y, r):
        return jax.lax.all_to_all(y, self.axis, 0, 0, tiled=True)


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

    def send(self, buf, fill, r):
        out = jnp.full(buf.shape, fill, buf.dtype)
        return self.collective(buf, out, self.slabs, self._sent(r)[1], self.mine, self._received(r))

    def back(self, y, r):
        out = jnp.zeros(y.shape, y.dtype)
        return self.collective(y, out, self.slabs, self._received(r), self.mine, self._sent(r)[1])
