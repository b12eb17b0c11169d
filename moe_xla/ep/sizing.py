"""Exchange sizing: the static buffer sizes of one chunk's exchange.

One peer can send one rank at most W = T_c min(k, E_l) (token, expert) pairs, in at most
T_c rows with dedup (W without); T_c is the chunk's token count, E_l = E / P + S the expert
slots per rank: its E / P own experts and S replica slots (redundant experts, S = 0
without). Without capacity_factor the exchange is sized for that worst case and runs in
one round. With capacity_factor f a round carries, per peer, at most C = f T_c k / P
pairs and f times a balanced routing's rows; R rounds, enough for any routing, then carry
the rows (see rounds.py). Where neither budget halves the worst case, the one worst-case
round instead.
"""

from __future__ import annotations

import math
from typing import NamedTuple


class ExchangeSizes(NamedTuple):
    """Static per-rank sizes of one chunk's exchange (see the module docstring).

    tokens: T_c, tokens of the chunk; peers: P; local_experts: E_l = E / P + S, a rank's own
        experts and its S replica slots.
    mult: local experts one row can ask for: min(k, E_l) with dedup, else 1.
    worst: W = T_c min(k, E_l), most (token, expert) pairs one peer can send one rank.
    capacity: C, pairs per peer per round (W in a one-round exchange).
    rows: rows per peer per round, the slab of the transport (in a one-round exchange T_c
        with dedup, W without).
    pairs: P C, the (row, local expert) pairs per rank per round: the grouped GEMMs' rows.
    rounds: R, enough rounds for any routing.
    """

    tokens: int
    peers: int
    local_experts: int
    mult: int
    worst: int
    capacity: int
    rows: int
    pairs: int
    rounds: int


def exchange_sizes(tokens, top_k, num_experts, peers, *, dedup=True, capacity_factor=None,
                   extra_slots=0) -> ExchangeSizes:
    """The buffer sizes of one chunk of `tokens` tokens per rank (ExchangeSizes).

    With redundant experts (extra_slots S replicas per rank) a rank serves E_l = E / P + S
    slots, and the worst case and mult are those of E_l; the balanced row budget below
    keeps E / P (a pair goes to one replica of its expert).

    With capacity_factor f the budgets are f times a balanced routing's load: C = f T_c k / P
    pairs and f T_c h rows per peer, h the rows one token sends one peer on average: k / P,
    or with dedup 1 - binom(E - E_l, k) / binom(E, k), the chance that k experts drawn
    uniformly include one of the peer's. With overflow rounds a rank holds two rounds'
    buffers (round 0's and the loop's), so budgets that do not halve the worst case (C >=
    W / 2 and rows >= half the worst-case rows: few ranks) cost memory instead of saving
    it; then the exchange is the worst-case one, in one round (benchmarks/results/LOG.md
    has the memory measured both ways).
    """
    owned = num_experts // peers
    local = owned + extra_slots
    per_rank = min(top_k, local)
    worst = tokens * per_rank
    mult, row_worst = (per_rank, tokens) if dedup else (1, worst)
    one_round = ExchangeSizes(tokens, peers, local, mult, worst, worst, row_worst, peers * worst, 1)
    if capacity_factor is None:
        return one_round
    hit = 1 - math.comb(num_experts - owned, top_k) / math.comb(num_experts, top_k) if dedup else top_k / peers
    capacity = min(worst, max(mult, math.ceil(capacity_factor * tokens * top_k / peers)))
    rows = min(row_worst, capacity, max(1, math.ceil(capacity_factor * tokens * hit)))
    if 2 * capacity >= worst and 2 * rows >= row_worst:
        return one_round
    if mult == 1:  # a row is a pair: every round but the last holds `rows` (<= C) of them
        rounds = -(-worst // rows)
    else:  # every round but the last holds `rows` rows or more than C - mult pairs
        rounds = tokens // rows + worst // (capacity - mult + 1) + 1
    return ExchangeSizes(tokens, peers, local, mult, worst, capacity, rows, peers * capacity, rounds)
