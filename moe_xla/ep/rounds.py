"""Capacity rounds: a chunk's rows cut into rounds that fit the exchange's budgets, and
the loop that runs rounds 1 .. R-1.

The rows bound for each destination are cut greedily: each round takes, from where the
last stopped, as many rows as fit both `rows` rows and `capacity` pairs (sizing.py), and
R rounds cover any routing. Round 0 runs as part of the layer; rounds 1 .. R-1 run in a
loop of R - 1 iterations, a trip count fixed by the shapes: nothing in the step depends
on a value read back to the host. Under autodiff the same loop re-runs each round under
jax.jvp (forward) or jax.vjp (reverse) through the primitive ep_rounds_tangent, so no
round's buffers are stacked or kept.

What the fixed trip count costs: all R - 1 later rounds run whatever the routing, even
when every row fits in round 0. A round with no rows adds zeros (bitwise, the sum is that
of the rounds with rows), but it still runs in full: the permute of its lids and the
expand into the [P C, H] pair buffer, the two grouped products over those zero-filled
buffers (no multiply-adds for empty groups, but every output row written), the
activation over all P C rows, and the sum of its results back (unpermute). In reverse mode each round is recomputed
under jax.vjp (its forward again, then its transpose) and adds a full-size weight
gradient, [E_l, H, 2F] and [E_l, F, H], to the loop's sum. With the padded transport
every round also moves its full slabs, `rows` rows to each peer and back: R - 1 slab
exchanges after round 0's in the forward pass even when round 0 held every row, and
again for the recomputation and its transpose in reverse mode. What that comes to for
the benchmark cases (R, slab rows, the time measured on 8 CPU devices) is in the README's
expert-parallelism section and benchmarks/results/LOG.md.
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
    """What a round differentiates in: the sender's tokens, its rows' weights and the expert weights."""

    x: jax.Array           # [T, H] the tokens (each round packs its rows from them)
    w: jax.Array | None    # [T*n, mult] float32 the routing weights of the token's rows (dedup), else None
    w_in: jax.Array        # [E_l, H, 2F] or [E_l, H, F], this rank's E / P experts, then its S replicas
    w_out: jax.Array       # [E_l, F, H]


class RoundInts(NamedTuple):
    """What a round reads but does not differentiate in."""

    lids: jax.Array        # [T*n, mult] int32 the slots the token's rows ask for, numbered over all ranks (rows.Rows)
    dest: jax.Array        # [T, n] int32 the ranks of the token's rows (P: none; rows.Rows)
    row: jax.Array         # [T, n] int32 their places among the rows grouped by destination
    source: jax.Array      # [T*k] int32 grouped row -> (t, c) flattened (T*n: none)
    link: LinkArrays       # the chunk's round starts (transports.link_arrays)
    x_fp8: tuple | None    # FP8 expert products: the tokens' FP8 rows (fp8_dispatch.quantized_tokens), sent instead


def round_starts(counts, pairs, sizes: ExchangeSizes):
    """[R+1, P] int32: round r sends the grouped rows [starts[r, d], starts[r+1, d]) to d,
    as many rows from where round r - 1 stopped as fit `rows` rows and `capacity` pairs.
    counts [P]: rows per destination; pairs [T*k]: the pairs each row carries."""
    ends = jnp.cumsum(counts, dtype=jnp.int32)
    offsets = ends - counts
    if sizes.rounds == 1:  # sized for the worst case: one round holds every row (sizing.py)
        return jnp.stack([offsets, ends])
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
