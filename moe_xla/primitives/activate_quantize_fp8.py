"""activate_quantize_fp8: the expert activation fused with the FP8 row quantisation of its
output, the step between the two grouped products of the FP8 expert MLP (contract in
common/expert_activation.h and common/fp8_blockwise.h).

    h [M, 2F] (gate | up; "swiglu", "geglu") or [M, F] ("gelu", "silu", "relu"), float32 /
    bfloat16 / float16
      -> a [M, F] in h's dtype: the expert activation act(h), computed in float32 and rounded
         a[m, f] = g(h[m, f]) * h[m, F + f] (gated) or g(h[m, f])
      -> q [M, F] float8_e4m3fn, scales [M, ceil(F/128)] float32 = quantize_fp8_rows(a),
         bitwise, of the a returned

One pass over h where the unfused path reads h, writes a, then reads a again to quantise
it. The kernels' exp and tanh are their platform's float32 functions, so a may differ from
the jnp activation (reference.activate_quantize_fp8) by a few ulps before rounding.
Handlers MoeXlaActivateQuantizeFp8{Cpu,Cuda} in ffi/quantize_fp8_{cpu,cuda}.cc; kernels
cpu/fp8_quantize.cc (fp8_activate_quantize) and cuda/fp8_quantize.cu (the Activated
source of the row quantisation kernel).

Not differentiable itself (see _fp8): moe_xla.fp8.gmm_activate_fp8 runs it inside a
custom_vjp whose backward is activate_grad_quantize_fp8 (q and scales feed the FP8
product, whose straight-through rule differentiates a). Rows are independent: the op shards along M and
vmaps by folding the batch into M.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import ad, batching

from moe_xla.primitives import _batching, _checks, _fp8, _impl, _lowering, _sharding
from moe_xla.primitives._activation import ACTIVATIONS, GATED


activate_quantize_fp8_p = Primitive("moe_xla_activate_quantize_fp8")
activate_quantize_fp8_p.multiple_results = True


def activate_quantize_fp8(h, activation: str, *, pow2_scale=False):
    """(a, q, scales) of h [..., 2F] (gated) or [..., F]: a = act(h) in h's dtype and its
    1 x 128 row quantisation. See the module docstring."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activate_quantize_fp8: expected activation in {ACTIVATIONS}, got {activation!r}")
    pow2_scale = _checks.static_bool("activate_quantize_fp8", "pow2_scale", pow2_scale)
    if jnp.ndim(h) < 2:
        raise ValueError(f"activate_quantize_fp8: expected h of rank >= 2 [..., M, 2F or F], got shape {jnp.shape(h)}")
    lead, c = h.shape[:-1], h.shape[-1]
    a, q, scales = activate_quantize_fp8_p.bind(h.reshape(math.prod(lead), c), activation=activation,
                                                pow2_scale=pow2_scale)
    return a.reshape(*lead, a.shape[-1]), q.reshape(*lead, q.shape[-1]), scales.reshape(*lead, scales.shape[-1])


def _abstract_eval(h, *, activation, pow2_scale):
    _checks.rank("activate_quantize_fp8", "h", h, 2, "[M, 2F] or [M, F]")
    _checks.float_dtype("activate_quantize_fp8", "h", h)
    m, c = h.shape
    if activation in GATED and c % 2:
        raise ValueError(f"activate_quantize_fp8: gated activation {activation!r} needs h [M, 2F] (gate | up), "
                         f"got an odd last dim {c}")
    f = c // 2 if activation in GATED else c
    q, scales = _fp8.outputs((m, f), (m, _fp8.tiles(f)))
    return [jax.core.ShapedArray((m, f), h.dtype), q, scales]


def _batch(args, dims, *, activation, pow2_scale):
    (h,), _ = _batching.batched_to_front(args, dims)
    b, m, c = h.shape
    out = activate_quantize_fp8_p.bind(h.reshape(b * m, c), activation=activation, pow2_scale=pow2_scale)
    return [o.reshape(b, m, o.shape[-1]) for o in out], [0, 0, 0]


def _specs(arg_axes, **_):
    m = arg_axes[0][0]
    return ([(m, ())], [(m, ())] * 3, ())


# Rows are independent: split along M; the columns (gate | up, and their tiles) stay whole.
SHARDING = _sharding.Rule(sharding_rule=lambda **_: "m c -> m f, m f, m t", specs=_specs,
                          need_replication=("c", "f", "t"))


def activation_attributes(*, activation, pow2_scale):
    """The FFI attributes of this primitive, of activate_grad_quantize_fp8 and of their
    _group_cols twins."""
    return dict(activation=np.int32(ACTIVATIONS.index(activation)), pow2_scale=pow2_scale)


_impl.def_jitted_impl(activate_quantize_fp8_p)
activate_quantize_fp8_p.def_abstract_eval(_abstract_eval)
ad.primitive_jvps[activate_quantize_fp8_p] = _fp8.not_differentiable(
    "activate_quantize_fp8", "differentiate moe_xla.fp8.gmm_activate_fp8, which runs it with the activation's "
    "derivative")
batching.primitive_batchers[activate_quantize_fp8_p] = _batch
_lowering.register(activate_quantize_fp8_p, "activate_quantize_fp8", activation_attributes, sharding=SHARDING)
