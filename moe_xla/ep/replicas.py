"""Replica weights: a rank's expert weights extended by copies of the experts it hosts as
replicas (placement.py), gathered from their owners inside the layer's shard_map.

    slots_p = [w_p[0], ..., w_p[E_l - 1], w[placement[p][0]], ..., w[placement[p][S - 1]]]

One all_to_all over the expert axis moves the copies: rank q sends rank p, in a block of
M experts, those of its own experts that p replicates (in p's slot order; M the largest
such count over all (q, p), unused places padded with q's expert 0), and p picks its S
slots out of the P blocks it receives. The gather and the all_to_all transpose to a
scatter-add and an all_to_all, so autodiff sums each replica's weight gradient back into
its owner's. The send and receive buffers hold P M experts per rank.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def _routes(placement: tuple, local: int):
    """(send [P, P*M] int32: send[q] the local experts q sends, block p for rank p;
    pick [P, S] int32: pick[p, s] the place of p's slot s in what p receives)."""
    peers = len(placement)
    wanted = [[[(s, e % local) for s, e in enumerate(placement[p]) if e // local == q] for p in range(peers)]
              for q in range(peers)]
    block = max(len(w) for row in wanted for w in row)
    send = np.zeros((peers, peers, block), np.int32)
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
    received = jax.lax.all_to_all(w[jnp.asarray(send)[rank]], axis, 0, 0, tiled=True)
    return jnp.concatenate([w, received[jnp.asarray(pick)[rank]]])
