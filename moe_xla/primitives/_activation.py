"""The expert activations in jnp, below the layer: the primitives whose rules are written
with them (activate_gmm_combine_tangent, activate_weighted_grad) import them from here, and
moe_xla.activations, the layer's name for them, re-exports them (its docstring states the
functions).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

GATED = {"swiglu": jax.nn.silu, "geglu": lambda g: jax.nn.gelu(g, approximate=True)}
PLAIN = {"gelu": lambda h: jax.nn.gelu(h, approximate=True), "silu": jax.nn.silu, "relu": jax.nn.relu}
# In the order of their FFI attribute value (Activation in common/expert_activation.h).
ACTIVATIONS = tuple(GATED) + tuple(PLAIN)


def activate_f32(h32, activation: str):
    """The expert activation of float32 h, in float32 (not rounded)."""
    if activation in GATED:
        gate, up = jnp.split(h32, 2, axis=-1)
        return GATED[activation](gate) * up
    return PLAIN[activation](h32)


def activate(h, activation: str):
    """The expert activation on [rows, 2F] (gated: act(gate) * up) or [rows, F]."""
    return activate_f32(h.astype(jnp.float32), activation).astype(h.dtype)


def weighted(h, omega, activation: str):
    """The routing-weighted activation b[r] = omega[r] * a[r], a = activate(h) (rounded to h's
    dtype), omega [rows] float32: the product in float32, rounded to h's dtype."""
    return (omega[:, None] * activate(h, activation).astype(jnp.float32)).astype(h.dtype)


def weighted_tangent(h, omega, d_h, d_omega, activation: str):
    """The tangent of the routing-weighted activation b[r] = omega[r] * a[r], a = activate(h)
    (rounded to h's dtype, as the forward uses it), omega [rows] float32:

        d b = omega * act'(h) d_h + d_omega * a     in float32, rounded to h's dtype

    Linear in (d_h, d_omega); its transpose at a cotangent g is common/expert_activation.h's
    ActivateWeightedGradParams contract: d h = act'(h)^T (omega * g) (omega * g not
    rounded), d omega = <g, a>."""
    h32 = h.astype(jnp.float32)
    a, d_a = jax.jvp(lambda v: activate_f32(v, activation), (h32,), (d_h.astype(jnp.float32),))
    a = a.astype(h.dtype).astype(jnp.float32)
    return (omega[:, None] * d_a + d_omega[:, None] * a).astype(h.dtype)
