"""activate_grad_quantize_fp8: the expert activation's backward fused with the FP8 row
quantisation of its result (the contract is common/expert_activation.h and
common/fp8_blockwise.h).

    h [M, 2F] (gated: gate | up) or [M, F], da [M, F], both float32 / bfloat16 / float16
      -> dh [M, C] in h's dtype (C = h's last dim): d/dh of sum(act(h) * da), computed in
           float32 and rounded,
           gated:  d gate = da * up * g'(gate),  d up = da * g(gate);  plain: da * g'(h)
         q [M, C] float8_e4m3fn, scales [M, ceil(C/128)] float32: quantize_fp8_rows(dh),
           bitwise (tiles run across the gate | up boundary when F % 128 != 0).

What the FP8 expert MLP's backward runs between its two products: dh feeds the bf16
weight gradient of the first product, (q, scales) its FP8 dgrad, in one pass over h and
da. The kernels' exp and tanh are their platform's, so dh may differ from
reference.activate_grad_quantize_fp8 (jax.vjp of the jnp activation) by a few ulps
before rounding. A primitive of the backward, so not differentiable itself. Rows are
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


def activate_grad_quantize_fp8(h, da, activation: str, *, pow2_scale=False):
    """(dh, q, scales) of h [..., 2F] (gated) or [..., F] and da [..., F]. See the module
    docstring."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"{_OP}: expected activation in {ACTIVATIONS}, got {activation!r}")
    pow2_scale = _checks.static_bool(_OP, "pow2_scale", pow2_scale)
    if jnp.ndim(h) < 2:
        raise ValueError(f"{_OP}: expected h of rank >= 2 [..., M, 2F or F], got shape {jnp.shape(h)}")
    lead, c = h.shape[:-1], h.shape[-1]
    if tuple(jnp.shape(da)[:-1]) != tuple(lead):
        raise ValueError(f"{_OP}: expected da of leading shape {tuple(lead)} (h's), got shape {jnp.shape(da)}")
    rows = math.prod(lead)
    dh, q, scales = activate_grad_quantize_fp8_p.bind(h.reshape(rows, c), da.reshape(rows, da.shape[-1]),
                                                      activation=activation, pow2_scale=pow2_scale)
    return dh.reshape(*lead, c), q.reshape(*lead, c), scales.reshape(*lead, scales.shape[-1])


def _abstract_eval(h, da, *, activation, pow2_scale):
    _checks.rank(_OP, "h", h, 2, "[M, 2F] or [M, F]")
    _checks.rank(_OP, "da", da, 2, "[M, F]")
    _checks.float_dtype(_OP, "h", h)
    _checks.same_dtype(_OP, "h", h, "da", da)
    m, c = h.shape
    if activation in GATED and c % 2:
        raise ValueError(f"{_OP}: gated activation {activation!r} needs h [M, 2F] (gate | up), got an odd last dim {c}")
    f = c // 2 if activation in GATED else c
    if tuple(da.shape) != (m, f):
        raise ValueError(f"{_OP}: expected da of shape {(m, f)} ([M, F] for h {tuple(h.shape)}), got {tuple(da.shape)}")
    q, scales = _fp8.outputs((m, c), (m, _fp8.tiles(c)))
    return [jax.core.ShapedArray((m, c), h.dtype), q, scales]


def _batch(args, dims, *, activation, pow2_scale):
    (h, da), _ = _batching.all_to_front(args, dims)
    b, m, c = h.shape
    out = activate_grad_quantize_fp8_p.bind(h.reshape(b * m, c), da.reshape(b * m, da.shape[-1]),
                                            activation=activation, pow2_scale=pow2_scale)
    return [o.reshape(b, m, o.shape[-1]) for o in out], [0, 0, 0]


def _specs(arg_axes, **_):
    m = arg_axes[0][0]
    return ([(m, ()), (m, ())], [(m, ())] * 3, ())


# Rows are independent: split along M; the columns (gate | up, and their tiles) stay whole.
SHARDING = _sharding.Rule(sharding_rule=lambda **_: "m c, m f -> m c, m c, m t", specs=_specs,
                          need_replication=("c", "f", "t"))


_impl.def_jitted_impl(activate_grad_quantize_fp8_p)
activate_grad_quantize_fp8_p.def_abstract_eval(_abstract_eval)
ad.primitive_jvps[activate_grad_quantize_fp8_p] = _fp8.not_differentiable(
    _OP, "it is the FP8 expert MLP's backward (moe_xla.fp8.gmm_activate_fp8)")
batching.primitive_batchers[activate_grad_quantize_fp8_p] = _batch
_lowering.register(activate_grad_quantize_fp8_p, _OP, activation_attributes, sharding=SHARDING)
