"""Redundant experts: where hot experts get replicas, and which replica serves a token.

A placement is a tuple of P tuples, placement[p] the S experts rank p hosts as replicas,
in its extra slots E_l .. E_l + S - 1 (E_l = E / P; S <= E_l, the same on every rank).
It is a static (hashable) option of the layer: a new placement is a new program.
Expert e then lives on n_e ranks: its owner e // E_l (slot e % E_l) first, then the
ranks hosting a replica in rank order; the pair (t, j) of token t (its index among the
rank's tokens) goes to replica c = t mod n_e of expert ids[t, j], so the tokens of an
expert split evenly and deterministically among its replicas.

place_redundant_experts computes a placement from tokens_per_expert statistics (moe()'s
aux); its docstring states the rule.
"""

from __future__ import annotations

import numbers

import jax.numpy as jnp
import numpy as np


def place_redundant_experts(tokens_per_expert, peers: int, slots: int) -> tuple:
    """A placement (module docstring) of `slots` replicas per rank on `peers` ranks, from
    tokens_per_expert [E] (loads, e.g. moe()'s aux.tokens_per_expert summed over steps).

    Greedy: a rank's load is the sum over the experts it hosts of load_e / n_e (an
    expert's tokens split evenly among its n_e replicas). P * S times, the expert with the
    largest load per replica, load_e / n_e, gets a replica on the least loaded rank with a
    free slot that does not host it yet (ties: the lower expert, the lower rank)."""
    load = np.asarray(tokens_per_expert, np.float64)
    if load.ndim != 1:
        raise ValueError(f"place_redundant_experts: expected tokens_per_expert of shape [E], got {load.shape}")
    experts = load.shape[0]
    check_slots(slots, experts, peers, "place_redundant_experts")
    if slots and peers == 1:
        raise ValueError(f"place_redundant_experts: expected peers > 1 for slots={slots}: one rank owns every "
                         f"expert already")
    local = experts // peers
    hosts = [[e // local] for e in range(experts)]
    rank_load = np.bincount(np.arange(experts) // local, weights=load, minlength=peers)
    placement = [[] for _ in range(peers)]
    for _ in range(peers * slots):
        # a free rank always hosts fewer than E experts (E_l + S <= 2 E_l <= E), so some
        # expert with n_e < P can go there: the loop always places one
        for e in sorted(range(experts), key=lambda e: (-load[e] / len(hosts[e]), e)):
            free = [p for p in range(peers) if len(placement[p]) < slots and p not in hosts[e]]
            if free:
                break
        rank = min(free, key=lambda p: (rank_load[p], p))
        n = len(hosts[e])
        rank_load[hosts[e]] -= load[e] / n - load[e] / (n + 1)
        rank_load[rank] += load[e] / (n + 1)
        hosts[e].append(rank)
        placement[rank].append(e)
    return tuple(tuple(p) for p in placement)


def check_slots(slots, experts: int, peers: int, where: str):
    """A ValueError unless 0 <= slots <= E / P."""
    if not isinstance(slots, numbers.Integral) or not 0 <= slots <= experts // peers:
        raise ValueError(f"{where}: expected slots per rank an int in [0, E / P = {experts // peers}] "
                         f"({experts} experts, {peers} ranks), got {slots!r}")


def check_placement(placement, experts: int, peers: int) -> tuple:
    """placement as a tuple of P tuples of ints (module docstring), or a ValueError naming
    what is wrong; None gives P empty tuples (no replicas)."""
    if placement is None:
        return ((),) * peers
    where = "moe: redundant_experts"
    try:
        placement = tuple(tuple(int(e) for e in rank) for rank in placement)
    except (TypeError, ValueError):
        raise ValueError(f"{where}: expected a sequence of {peers} sequences of expert ids, got {placement!r}") \
            from None
    if len(placement) != peers:
        raise ValueError(f"{where}: expected one tuple of replicated experts per rank ({peers}), got "
                         f"{len(placement)}")
    slots = len(placement[0])
    if any(len(rank) != slots for rank in placement):
        raise ValueError(f"{where}: expected as many replicas on every rank, got {[len(r) for r in placement]}")
    check_slots(slots, experts, peers, where)
    local = experts // peers
    for p, rank in enumerate(placement):
        if any(not 0 <= e < experts for e in rank) or len(set(rank)) < slots or any(e // local == p for e in rank):
            raise ValueError(f"{where}: expected rank {p}'s replicas to be distinct experts in [0, {experts}) "
                             f"that rank {p} does not own ([{p * local}, {(p + 1) * local})), got {rank}")
    return placement


def replica_table(placement: tuple, experts: int):
    """(table [E, P, 2] int32, count [E] int32): table[e, c] the (rank, slot) of expert e's
    replica c < count[e] = n_e, the owner's first (module docstring); rows past n_e repeat
    the owner's (never read)."""
    peers = len(placement)
    local = experts // peers
    owner = np.stack([np.arange(experts) // local, np.arange(experts) % local], axis=-1)
    table = np.repeat(owner[:, None], peers, axis=1).astype(np.int32)
    count = np.ones(experts, np.int32)
    for p, rank in enumerate(placement):
        for s, e in enumerate(rank):
            table[e, count[e]] = (p, local + s)
            count[e] += 1
    return table, count


def expert_slots(ids, placement: tuple, experts: int):
    """[T, k] int32: the slot that serves pair (t, j) of a rank's tokens routed to ids
    [T, k], replica c = t mod n_e (module docstring), numbered over all ranks: rank d's
    slot s is d L + s, L = E / P + S its slots, so the pair goes to rank slot // L, slot
    slot % L there. Without replicas (L = E / P) that is ids itself: nothing computed."""
    if not placement[0]:
        return ids
    table, count = replica_table(placement, experts)
    numbered = table[..., 0] * (experts // len(placement) + len(placement[0])) + table[..., 1]
    choice = jnp.arange(ids.shape[0], dtype=jnp.int32)[:, None] % jnp.asarray(count)[ids]
    return jnp.asarray(numbered)[ids, choice]
