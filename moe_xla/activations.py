"""The expert activations of moe() and the EP layer.

Gated ("swiglu", "geglu") on h [rows, 2F] = gate | up:   act(h) = g(gate) * up
    swiglu: g = silu;  geglu: g = gelu (tanh approximation, jax.nn.gelu's default)
Plain ("gelu", "silu", "relu") on h [rows, F]:            act(h) = g(h)
Computed in float32, returned in h's dtype.

The FP8 expert MLP runs it fused with the row quantisation of its output
(primitives/activate_quantize_fp8) and its backward fused likewise
(primitives/activate_grad_quantize_fp8), both through moe_xla.fp8.gmm_activate_fp8.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

GATED = {"swiglu": jax.nn.silu, "geglu": lambda g: jax.nn.gelu(g, approximate=True)}
PLAIN = {"gelu": lambda h: jax.nn.gelu(h, approximate=True), "silu": jax.nn.silu, "relu": jax.nn.relu}
ACTIVATIONS = tuple(GATED) + tuple(PLAIN)


def activate(h, activation: str):
    """The expert activation on [rows, 2F] (gated: act(gate) * up) or [rows, F]."""
    if activation in GATED:
        gate, up = jnp.split(h, 2, axis=-1)
        return (GATED[activation](gate.astype(jnp.float32)) * up.astype(jnp.float32)).astype(h.dtype)
    return PLAIN[activation](h.astype(jnp.float32)).astype(h.dtype)
