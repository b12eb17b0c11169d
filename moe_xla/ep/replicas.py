"""Replica weights: a rank's expert weights extended by copies of the experts it hosts as
replicas (placement.py), gathered from their owners inside the layer's shard_map.

    slots_p = [w_p[0], ..., w_p[E_l - 1], w[placement[p][0]], ..., w[placement[p][S - 1]]]

One all_to_all over the expert axis moves the copies: rank q sends rank p, in a block of
M experts, those of its own experts that p replicates (in p's slot order; M the largest
such count over all (q, p), unused places zero rows), and p picks its S slots out of the
P blocks it receives. Both row selections are select_rows, whose transpose is a gather
and a sum in a fixed order, not a scatter-add (whose atomics would add a replica's weight
gradients in a different order from run to run), and the all_to_all transposes to an
all_to_all, so autodiff sums each replica's weight gradient back into its owner's,
bitwise the same in every run.

Cost: the all_to_all is padded, so every rank sends and receives P M experts' weights of
w_in and of w_out per step, and as many weight gradients in the backward pass, however
few of them (S) it keeps. M, the largest number of experts one owner sends one rank,
reaches S when skew puts the hot experts on one owner and one rank takes all its S
replicas from it; with S = E / P that is P M = E, the whole layer's weights, per step in
each direction. Under the benchmarks' skewed routing at EP 8 with E / P replicas per
rank (benchmarks/ep_exchange.py's redundant_placement) P M is 128 of 128 experts for
qwen3-30b-a3b (bf16: 1.21 GB per rank each way, where its 16 replicas weigh 0.15 GB)
and 64 of 64 for deepseek-v3-like (5.6 GB, where its 8 replicas weigh 0.70 GB). An
exact-size transfer (ragged_all_to_all, or collective permutes by (owner, rank) pair)
would have each rank receive only its S replicas, but under that skew the hot owner would
still send most of them (rank 0 owns the experts of 100 of qwen3-30b-a3b's 128 replica
slots, 47 of deepseek-v3-like's 64), so the busiest link gains little unless replicas are
also copied from ranks that hold them already. The transport here is the padded one.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from moe_xla.primitives.select_rows import select_rows


def _routes(placement: tuple, local: int):
    """(send [P, P*M] int32: send[q] the local experts q sends, block p for rank p, local
    (no expert) where unused; pick [P, S] int32: pick[p, s] the place of p's slot s in what
    p receives)."""
    peers = len(placement)
    wanted = [[[(s, e % local) for s, e in enumerate(placement[p]) if e // local == q] for p in range(peers)]
              for q in range(peers)]
    block = max(len(w) for row in wanted for w in row)
    send = np.full((peers, peers, block), local, np.int32)
    pick = np.zeros((peers, len(placement[0])), np.int32)
    for q in range(peers):
        for p in range(peers):
            for m, (s, lid) in enumerate(wanted[q][p]):
                send[q, p, m] = lid
                pick[p, s] = q * block + m
    return send.reshape(peers, -1), pick


def with_replicas(w, placement: tuple, axis):
    """[E_l + S, ...]: this rank's experts w [E_l, ...], then its replicas (module docstring)."""
    if not placement[0]:
        return w
    send, pick = _routes(placement, w.shape[0])
    rank = jax.lax.axis_index(axis)
    received = jax.lax.all_to_all(select_rows(w, send, rank), axis, 0, 0, tiled=True)
    return jnp.concatenate([w, select_rows(received, pick, rank)])
