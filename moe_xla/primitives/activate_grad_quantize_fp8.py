"""activate_grad_quantize_fp8: the routing-weighted expert activation's backward fused with
the FP8 row quantisation of its result (the contract is Fp8ActivateGradQuantizeParams in
common/expert_activation.h, and common/fp8_blockwise.h). With g the cotangent of
b[r] = omega[r] * act(h[r]):

    h [M, 2F] (gated: gate | up) or [M, F], g [M, F], both float32 / bfloat16 / float16,
    omega [M] float32
      -> dh [M, C] in h's dtype (C = h's last dim): d/dh of sum_r omega[r] <act(h[r]), g[r]>,
           the activation's derivative at da = omega * g (formed in float32, not rounded),
           rounded once,
           gated:  d gate = da * up * g'(gate),  d up = da * g(gate);  plain: da * g'(h)
         q [M, C] float8_e4m3fn, scales [M, ceil(C/128)] float32: quantize_fp8_rows(dh),
           bitwise (tiles run across the gate | up boundary when F % 128 != 0)
         d_omega [M] float32: d/d omega[r] of the same, <g[r], a[r]> with a = act(h) rounded
           to h's dtype (the a the forward multiplied)

What the FP8 expert MLP's backward runs between its two products: dh feeds the bf16
weight gradient of the first product, (q, scales) its FP8 dgrad, d_omega the routing
weights' gradient, in one pass over h and g (omega = 1: the unweighted backward, da = g).
The kernels write d omega as sums over 128-column tiles of F (d_omega_tiles [M,
ceil(F/128)], each in its own order), added here in a fixed order. The kernels' exp and
tanh are their platform's, so dh may differ from reference.activate_grad_quantize_fp8
(jax.vjp of the jnp activation) by a few ulps before rounding, and d_omega by the
rounding of its sums. A primitive of the backward, so not differentiable itself. Rows are
independent: the op shards along M and vmaps by folding the batch into M.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import ad, batching

from moe_xla.primitives import _batching, _checks, _fp8, _impl, _lowering, _sharding
from moe_xla.primitives.activate_quantize_fp8 import ACTIVATIONS, GATED, activation_attributes

activate_grad_quantize_fp8_p = Primitive("moe_xla_activate_grad_quantize_fp8")
activate_grad_quantize_fp8_p.multiple_results = True

_OP = "activate_grad_quantize_fp8"


def activate_grad_quantize_fp8(h, g, omega, activation: str, *, pow2_scale=False):
    """(dh, q, scales, d_omega) of h [..., 2F] (gated) or [..., F], g [..., F] and omega
    [...] float32. See the module docstring."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"{_OP}: expected activation in {ACTIVATIONS}, got {activation!r}")
    pow2_scale = _checks.static_bool(_OP, "pow2_scale", pow2_scale)
    if jnp.ndim(h) < 2:
        raise ValueError(f"{_OP}: expected h of rank >= 2 [..., M, 2F or F], got shape {jnp.shape(h)}")
    lead, c = h.shape[:-1], h.shape[-1]
    if tuple(jnp.shape(g)[:-1]) != tuple(lead):
        raise ValueError(f"{_OP}: expected g of leading shape {tuple(lead)} (h's), got shape {jnp.shape(g)}")
    if tuple(jnp.shape(omega)) != tuple(lead):
        raise ValueError(f"{_OP}: expected omega of shape {tuple(lead)} (h's leading dims), got {jnp.shape(omega)}")
    rows = math.prod(lead)
    dh, q, scales, d_omega_tiles = activate_grad_quantize_fp8_p.bind(
        h.reshape(rows, c), g.reshape(rows, g.shape[-1]), omega.reshape(rows), activation=activation,
        pow2_scale=pow2_scale)
    d_omega = jnp.sum(d_omega_tiles, axis=1)
    return dh.reshape(*lead, c), q.reshape(*lead, c), scales.reshape(*lead, scales.shape[-1]), d_omega.reshape(lead)


def _abstract_eval(h, g, omega, *, activation, pow2_scale):
    m, c, f = _checks.activation_grad_operands(_OP, h, g, omega, activation, activation in GATED)
    q, scales = _fp8.outputs((m, c), (m, _fp8.tiles(c)))
    return [jax.core.ShapedArray((m, c), h.dtype), q, scales, jax.core.ShapedArray((m, _fp8.tiles(f)), jnp.float32)]


def _batch(args, dims, *, activation, pow2_scale):
    (h, g, omega), _ = _batching.all_to_front(args, dims)
    b, m, c = h.shape
    out = activate_grad_quantize_fp8_p.bind(h.reshape(b * m, c), g.reshape(b * m, g.shape[-1]),
                                            omega.reshape(b * m), activation=activation, pow2_scale=pow2_scale)
    return [o.reshape(b, m, o.shape[-1]) for o in out], [0] * 4


def _specs(arg_axes, **_):
    m = arg_axes[0][0]
    return ([(m, ()), (m, ()), (m,)], [(m, ())] * 4, ())


# Rows are independent: split along M; the columns (gate | up, and their tiles) stay whole.
SHARDING = _sharding.Rule(sharding_rule=lambda **_: "m c, m f, m -> m c, m c, m t, m u", specs=_specs,
                          need_replication=("c", "f", "t", "u"))


_impl.def_jitted_impl(activate_grad_quantize_fp8_p)
activate_grad_quantize_fp8_p.def_abstract_eval(_abstract_eval)
ad.primitive_jvps[activate_grad_quantize_fp8_p] = _fp8.not_differentiable(
    _OP, "it is the FP8 expert MLP's backward (moe_xla.fp8.gmm_activate_fp8)")
batching.primitive_batchers[activate_grad_quantize_fp8_p] = _batch
_lowering.register(activate_grad_quantize_fp8_p, _OP, activation_attributes, sharding=SHARDING)
