"""The auxiliary-loss-free balancing of DeepSeek-V3: route()'s selection bias nudged
towards the mean load after each step.

    bias_e <- bias_e + rate * sign(mean_e' load_e' - load_e)

An expert loaded above the mean is picked less often next step, one below it more often;
the routing weights do not use the bias (route(score="sigmoid")), so only the selection
moves. load is moe()'s aux.tokens_per_expert (summed over the batch, or over steps).

The bias is float32, the dtype route() takes, and the update refuses any other: the bias
accumulates steps of size rate (DeepSeek-V3: 1e-3) on values of order 1, which bfloat16
(8-bit significand: spacing 2^-9 on [0.25, 0.5), 2^-6 on [2, 4)) rounds to a whole
spacing, doubling them, or to nothing: 100 updates of rate 1e-3 take an overloaded
expert's 0.5 to 0.3047 instead of 0.4 and leave an underloaded one's 2.0 at 2.0. Keep a
float32 master copy of the bias even where the model's weights are bfloat16.
"""

from __future__ import annotations

import jax.numpy as jnp


def update_routing_bias(bias, tokens_per_expert, rate):
    """bias [E] float32 + rate * sign(mean(load) - load), load = tokens_per_expert [E], in
    float32 (module docstring). Works under jax.jit."""
    bias, load = jnp.asarray(bias), jnp.asarray(tokens_per_expert)
    if bias.ndim != 1:
        raise ValueError(f"update_routing_bias: expected a bias of shape [E], got {bias.dtype}{list(bias.shape)}")
    if bias.dtype != jnp.float32:
        raise ValueError(f"update_routing_bias: expected a float32 bias, got {bias.dtype}: steps of size rate "
                         "(e.g. 1e-3) round away or double in a narrower dtype, so keep the bias as a float32 "
                         "master copy (route() takes it as float32)")
    if load.shape != bias.shape:
        raise ValueError(f"update_routing_bias: expected tokens_per_expert of bias's shape {list(bias.shape)}, got "
                         f"{list(load.shape)}")
    load = load.astype(jnp.float32)
    return (bias + rate * jnp.sign(jnp.mean(load) - load)).astype(jnp.float32)
