"""activate_weighted_grad: the backward of the routing-weighted expert activation, in one
pass (contract: ActivateWeightedGradParams in common/expert_activation.h).

    h [M, 2F] (gated: gate | up) or [M, F], g [M, F] of h's dtype (float32 / bfloat16 /
    float16), omega [M] float32
      -> dh [M, C] in h's dtype (C = h's last dim): d/dh of sum_r <omega[r] act(h[r]), g[r]>
           = act'(h)^T (omega * g), omega * g formed in float32 and not rounded, the result
           rounded once
         d_omega [M] float32: d/d omega of the same, <g[r], a[r]> with a = act(h) rounded to
           h's dtype (the a the forward multiplied)
         weighted [M, F] in h's dtype: b = omega * a (primitives/_activation.weighted), the
           rows the second product's weight gradient reads; written into g's buffer (an
           operand-output alias: XLA copies g first only where something still reads it)

(d h, d omega) is the transpose of primitives/_activation.weighted_tangent in (d_h,
d_omega) at g; primitives/activate_gmm_combine_tangent's transpose binds it. Where the
unfused backward of moe()'s second product reads h for act(h), for act'(h), for the routing
weights' gradient and for b in separate passes, this reads h and g once and writes d h,
d omega and b. The kernels' exp and tanh are their platform's and d_omega sums in their own
order, so the results may differ from reference.activate_weighted_grad by a few ulps.
Handlers MoeXlaActivateWeightedGrad{Cpu,Cuda}V2 in ffi/activate_weighted_grad_{cpu,cuda}.cc;
kernels cpu/activate_weighted_grad.cc, cuda/activate_weighted_grad.cu.

Its derivatives (second order, for a gradient of a gradient) are those of its jnp formula.
Rows are independent: the op shards along M and vmaps by folding the batch into M.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import ad, batching

from moe_xla.primitives import _batching, _checks, _impl, _lowering, _sharding
from moe_xla.primitives._activation import ACTIVATIONS, GATED, weighted, weighted_tangent

OP = "activate_weighted_grad"

activate_weighted_grad_p = Primitive("moe_xla_activate_weighted_grad")
activate_weighted_grad_p.multiple_results = True


def activate_weighted_grad(h, g, omega, activation: str):
    """(dh, d_omega, weighted) of h [M, 2F] (gated) or [M, F], g [M, F] and omega [M]. See
    the module docstring."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"{OP}: expected activation in {ACTIVATIONS}, got {activation!r}")
    return tuple(activate_weighted_grad_p.bind(h, g, omega, activation=activation))


def formula(h, g, omega, activation: str):
    """The op in jnp: the transpose of weighted_tangent in (d_h, d_omega) at g, and b."""
    _, transpose = jax.vjp(lambda d_h, d_omega: weighted_tangent(h, omega, d_h, d_omega, activation),
                           jnp.zeros_like(h), jnp.zeros_like(omega))
    return (*transpose(g), weighted(h, omega, activation))


def _abstract_eval(h, g, omega, *, activation):
    m, c, _ = _checks.activation_grad_operands(OP, h, g, omega, activation, activation in GATED)
    return [jax.core.ShapedArray((m, c), h.dtype), jax.core.ShapedArray((m,), jnp.float32),
            jax.core.ShapedArray(g.shape, h.dtype)]


def _jvp(primals, tangents, *, activation):
    out = activate_weighted_grad_p.bind(*primals, activation=activation)
    tangents = [ad.instantiate_zeros(t) for t in tangents]
    _, d_out = jax.jvp(lambda *args: formula(*args, activation), tuple(primals), tuple(tangents))
    return out, list(d_out)


def _batch(args, dims, *, activation):
    (h, g, omega), size = _batching.all_to_front(args, dims)
    m = h.shape[1]
    dh, d_omega, b = activate_weighted_grad_p.bind(h.reshape(size * m, h.shape[2]), g.reshape(size * m, g.shape[2]),
                                                   omega.reshape(size * m), activation=activation)
    return [dh.reshape(size, m, dh.shape[-1]), d_omega.reshape(size, m), b.reshape(size, m, b.shape[-1])], [0, 0, 0]


def _specs(arg_axes, **_):
    m = arg_axes[0][0]
    return ([(m, ()), (m, ()), (m,)], [(m, ()), (m,), (m, ())], ())


# Rows are independent: split along M; the columns (gate | up) stay whole.
SHARDING = _sharding.Rule(sharding_rule=lambda **_: "m c, m f, m -> m c, m, m f", specs=_specs,
                          need_replication=("c", "f"))


_impl.def_jitted_impl(activate_weighted_grad_p)
activate_weighted_grad_p.def_abstract_eval(_abstract_eval)
ad.primitive_jvps[activate_weighted_grad_p] = _jvp
batching.primitive_batchers[activate_weighted_grad_p] = _batch
# weighted (result 2) takes g's (operand 1) buffer.
_lowering.register(activate_weighted_grad_p, OP, lambda *, activation: dict(
    activation=np.int32(ACTIVATIONS.index(activation))), sharding=SHARDING, output_aliases={1: 2})
