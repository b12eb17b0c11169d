"""The expert activations of moe() and the EP layer.

Gated ("swiglu", "geglu") on h [rows, 2F] = gate | up:   act(h) = g(gate) * up
    swiglu: g = silu;  geglu: g = gelu (tanh approximation, jax.nn.gelu's default)
Plain ("gelu", "silu", "relu") on h [rows, F]:            act(h) = g(h)
Computed in float32, returned in h's dtype.

activate_fp8 is the same activation fused with the FP8 row quantisation of its output
(primitives/activate_quantize_fp8: one kernel), differentiable through a as activate.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from moe_xla.primitives import activate_quantize_fp8 as _fused

GATED = {"swiglu": jax.nn.silu, "geglu": lambda g: jax.nn.gelu(g, approximate=True)}
PLAIN = {"gelu": lambda h: jax.nn.gelu(h, approximate=True), "silu": jax.nn.silu, "relu": jax.nn.relu}
ACTIVATIONS = tuple(GATED) + tuple(PLAIN)


def activate(h, activation: str):
    """The expert activation on [rows, 2F] (gated: act(gate) * up) or [rows, F]."""
    if activation in GATED:
        gate, up = jnp.split(h, 2, axis=-1)
        return (GATED[activation](gate.astype(jnp.float32)) * up.astype(jnp.float32)).astype(h.dtype)
    return PLAIN[activation](h.astype(jnp.float32)).astype(h.dtype)


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def activate_fp8(h, activation: str):
    """(a, q, scales): a = activate(h, activation) and its 1 x 128 row quantisation
    (quantize_fp8_rows(a), bitwise) from one kernel. a's derivative is activate's; q and
    scales have none (the FP8 product's straight-through rule differentiates a)."""
    return _fused.activate_quantize_fp8(h, activation)


@activate_fp8.defjvp
def _activate_fp8_jvp(activation, primals, tangents):
    (h,), (dh,) = primals, tangents
    a, q, scales = activate_fp8(h, activation)
    da = jax.jvp(lambda v: activate(v, activation), (h,), (dh,))[1]
    return (a, q, scales), (da, jnp.zeros_like(q), jnp.zeros_like(scales))
