"""after: x, once dep has been computed; an ordering edge for XLA's scheduler, no data moved.

    after(x, dep) = x        any x, any dep

Lowered, on the kernel platforms, to an FFI call (ffi/after.cc) whose result is x's own
buffer (an operand-output alias) and which launches nothing: its only effect is that
every consumer of the result waits for dep's producer. XLA expands
lax.optimization_barrier before it schedules, so that cannot order two independent
computations; this can. Product_combine's backward uses it to finish the expert weight
gradient, which reads the rows b = omega * a of the activation's backward, before the
first product's backward starts, so that b and the cotangent rows it pairs with are freed
before that product's larger operands are live (primitives/activate_gmm_combine_tangent).

Its derivative is x's (dep gets no tangent and no cotangent); vmap orders the batched x
after the batched dep; under MOE_XLA_IMPL=reference it lowers to x (no ordering), and on
a platform without the kernels it raises as every moe_xla primitive does.
Over a mesh (the call) the result keeps x's sharding and dep's is left as it is.
"""

from __future__ import annotations

from jax.extend.core import Primitive
from jax.interpreters import ad, batching

from moe_xla.primitives import _impl, _lowering, _sharding

OP = "after"

after_p = Primitive("moe_xla_after")


def after(x, dep):
    """x, computed after dep (module docstring)."""
    return after_p.bind(x, dep, x_rank=x.ndim, dep_rank=dep.ndim)


def _jvp(primals, tangents, **params):
    return after_p.bind(*primals, **params), tangents[0]


def _transpose(ct, x, dep, **_):
    return ct, None


def _batch(args, dims, **_):
    return after(*args), dims[0]


def _letters(start: int, rank: int) -> str:
    return " ".join(f"d{i}" for i in range(start, start + rank))


# The result is x: its dimensions are x's factors; dep's are factors of their own.
SHARDING = _sharding.Rule(
    sharding_rule=lambda *, x_rank, dep_rank: (f"{_letters(0, x_rank)}, {_letters(x_rank, dep_rank)} -> "
                                               f"{_letters(0, x_rank)}"),
    specs=lambda arg_axes, **_: (list(arg_axes), [arg_axes[0]], ()))


_impl.def_jitted_impl(after_p)
after_p.def_abstract_eval(lambda x, dep, **_: x)
ad.primitive_jvps[after_p] = _jvp
ad.primitive_transposes[after_p] = _transpose
batching.primitive_batchers[after_p] = _batch
_lowering.register(after_p, OP, lambda **_: {}, sharding=SHARDING, output_aliases={0: 0})
