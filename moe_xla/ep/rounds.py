"""Capacity rounds: a chunk's rows cut into rounds that fit the exchange's budgets, and
the loop that runs rounds 1 .. R-1.

The rows bound for each destination are cut greedily: each round takes, from where the
last stopped, as many rows as fit both `rows` rows and `capacity` pairs (sizing.py), and
R rounds cover any routing. Round 0 runs as part of the layer; rounds 1 .. R-1 run in a
loop of R - 1 iterations, a trip count fixed by the shapes: nothing in the step depends
on a value read back to the host. A round with no rows adds zeros (bitwise, the sum is
that of the rounds with rows); its grouped GEMMs skip their empty groups, but the padded
transport still moves its slabs, so a step that fits in round 0 pays R - 1 slab
exchanges. Under autodiff the same loop re-runs each round under jax.jvp (forward) or
jax.vjp (reverse) through the primitive ep_rounds_tangent, so no round's buffers are
stacked or kept.
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp

from moe_xla.ep.sizing import ExchangeSizes
from moe_xla.ep.transports import LinkArrays
from moe_xla.primitives.ep_rounds_tangent import RoundsSpec, rounds_loop, rounds_tangent_p


class RoundFloats(NamedTuple):
    """What a round differentiates in: the sender's grouped rows and the expert weights."""

    x: jax.Array           # [T*k, H] the rows, grouped by destination
    w: jax.Array | None    # [T*k, mult] float32 their routing weights (dedup), else None
    w_in: jax.Array        # [E_l, H, 2F] or [E_l, H, F], this rank's experts
    w_out: jax.Array       # [E_l, F, H]


class RoundInts(NamedTuple):
    """What a round reads but does not differentiate in."""

    lids: jax.Array        # [T*k, mult] int32 the local experts each row asks for; E_l: none
    link: LinkArrays       # the chunk's round starts (transports.link_arrays)


def round_starts(counts, pairs, sizes: ExchangeSizes):
    """[R+1, P] int32: round r sends the grouped rows [starts[r, d], starts[r+1, d]) to d,
    as many rows from where round r - 1 stopped as fit `rows` rows and `capacity` pairs.
    counts [P]: rows per destination; pairs [T*k]: the pairs each row carries."""
    ends = jnp.cumsum(counts, dtype=jnp.int32)
    offsets = ends - counts
    before = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(pairs, dtype=jnp.int32)])  # pairs before row i

    def next_start(start, _):
        # the last row i with before[i] <= before[start] + C: before is non-decreasing, so
        # it is the number of such i, less one (comparisons and a sum: no search loop)
        fits = jnp.sum(before <= before[start][:, None] + sizes.capacity, axis=1, dtype=jnp.int32) - 1
        stop = jnp.minimum(jnp.minimum(start + sizes.rows, fits), ends)
        return stop, stop

    _, stops = jax.lax.scan(next_start, offsets, None, length=sizes.rounds)
    return jnp.concatenate([offsets[None], stops])


def add_later_rounds(round_fn, first, floats: RoundFloats, ints: RoundInts, rounds: int):
    """first + sum_{r = 1 .. R-1} round_fn(r, floats, ints), in a loop of R - 1 iterations.

    Reverse mode through a loop would keep every round's buffers, so the rounds are a
    custom_jvp whose tangent, sum_r J_r d_floats (J_r the Jacobian of round r in floats),
    is the linear primitive ep_rounds_tangent: forward mode runs the loop over jax.jvp of
    each round, reverse mode transposes the primitive into the same loop over jax.vjp of
    each round (recomputed: nothing stacked).
    """
    spec = RoundsSpec(round_fn, rounds, jax.tree.structure(floats), jax.tree.structure(ints),
                      jax.core.ShapedArray(first.shape, first.dtype))

    @jax.custom_jvp
    def add_later(first, floats, ints):
        return rounds_loop(spec, lambda r, acc: acc + round_fn(r, floats, ints), first)

    @add_later.defjvp
    def add_later_jvp(primals, tangents):  # tangents arrive instantiated (no symbolic zeros)
        first, floats, ints = primals
        d_first, d_floats, _ = tangents
        args = jax.tree.leaves(floats) + jax.tree.leaves(ints) + jax.tree.leaves(d_floats)
        return add_later(first, floats, ints), d_first + rounds_tangent_p.bind(*args, spec=spec, levels=())

    return add_later(first, floats, ints)
