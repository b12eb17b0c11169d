"""The expert activations of moe() and the EP layer.

Gated ("swiglu", "geglu") on h [rows, 2F] = gate | up:   act(h) = g(gate) * up
    swiglu: g = silu;  geglu: g = gelu (tanh approximation, jax.nn.gelu's default)
Plain ("gelu", "silu", "relu") on h [rows, F]:            act(h) = g(h)
Computed in float32, returned in h's dtype.

The FP8 expert MLP runs it fused with the row quantisation of its output
(primitives/activate_quantize_fp8) and its backward fused likewise
(primitives/activate_grad_quantize_fp8), both through moe_xla.fp8.gmm_activate_fp8. The
bf16 expert MLP's derivative weights it by the routing weights (weighted_tangent), whose
transpose is one kernel (primitives/activate_weighted_grad, through
primitives/activate_gmm_combine_tangent).
"""

from __future__ import annotations

from moe_xla.primitives._activation import ACTIVATIONS, GATED, PLAIN, activate, weighted_tangent

__all__ = ["ACTIVATIONS", "GATED", "PLAIN", "activate", "weighted_tangent"]
