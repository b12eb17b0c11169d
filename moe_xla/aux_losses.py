"""The router's training statistics and auxiliary losses (MoeAux) of moe() and the EP layer.

    load_balance_loss = E * sum_e f_e * P_e          (Switch Transformer)
        f_e: the fraction of the T*k assignments that went to e
        P_e: the mean over tokens of e's router probability: softmax(logits), or for
             sigmoid scores s = sigmoid(logits) normalised per token, s / sum_e s
    z_loss = mean_t logsumexp(logits[t])^2            (ST-MoE router z-loss)
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class MoeAux(NamedTuple):
    """Training statistics of one moe() call.

    tokens_per_expert: [E] int32, routed (token, expert) pairs per expert.
    load_balance_loss: E * sum_e f_e * P_e (Switch Transformer), f_e the fraction of the
        T*k assignments that went to e and P_e the mean router probability of e
        (softmax of the logits; for sigmoid scores, the scores normalised per token).
    z_loss: mean over tokens of logsumexp(router_logits)^2 (ST-MoE router z-loss).
    dispatched_rows: with expert parallelism, int32 rows sent over the expert axis, summed
        over ranks: T*k without dedup, the distinct (token, destination rank) pairs with
        it (a rank's rows to itself included); None without an expert_axis.
    """

    tokens_per_expert: jax.Array
    load_balance_loss: jax.Array
    z_loss: jax.Array
    dispatched_rows: jax.Array | None = None


def router_aux(logits, tokens_per_expert, score: str, top_k: int) -> MoeAux:
    """MoeAux of router logits [T, E] whose top_k routing gave tokens_per_expert [E]."""
    x = logits.astype(jnp.float32)
    tokens, experts = x.shape
    if score == "softmax":
        probs = jax.nn.softmax(x, axis=-1)
    else:
        s = jax.nn.sigmoid(x)
        probs = s / jnp.sum(s, axis=-1, keepdims=True)
    fraction = tokens_per_expert.astype(jnp.float32) / max(tokens * top_k, 1)
    balance = experts * jnp.sum(fraction * jnp.mean(probs, axis=0))
    z = jnp.mean(jax.nn.logsumexp(x, axis=-1) ** 2)
    return MoeAux(tokens_per_expert, balance, z)
