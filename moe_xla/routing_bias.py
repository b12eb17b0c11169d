"""The auxiliary-loss-free balancing of DeepSeek-V3: route()'s selection bias nudged
towards the mean load after each step.

    bias_e <- bias_e + rate * sign(mean_e' load_e' - load_e)

An expert loaded above the mean is picked less often next step, one below it more often;
the routing weights do not use the bias (route(score="sigmoid")), so only the selection
moves. load is moe()'s aux.tokens_per_expert (summed over the batch, or over steps).
"""

from __future__ import annotations

import jax.numpy as jnp


def update_routing_bias(bias, tokens_per_expert, rate):
    """bias [E] float + rate * sign(mean(load) - load), load = tokens_per_expert [E]; in
    bias's dtype (module docstring). Works under jax.jit."""
    bias, load = jnp.asarray(bias), jnp.asarray(tokens_per_expert)
    if bias.ndim != 1 or not jnp.issubdtype(bias.dtype, jnp.floating):
        raise ValueError(f"update_routing_bias: expected a float bias of shape [E], got {bias.dtype}{list(bias.shape)}")
    if load.shape != bias.shape:
        raise ValueError(f"update_routing_bias: expected tokens_per_expert of bias's shape {list(bias.shape)}, got "
                         f"{list(load.shape)}")
    load = load.astype(jnp.float32)
    return (bias + rate * jnp.sign(jnp.mean(load) - load)).astype(bias.dtype)
