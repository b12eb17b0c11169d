"""ragged_dot: a drop-in for jax.lax.ragged_dot, built on gmm.

    out[rows of g] = lhs[rows of g] @ rhs[g]; rows past sum(group_sizes) are zero.

lhs [M, K], rhs [G, K, N], group_sizes [G] (any integer dtype) -> [M, N]. Operands are
floating (bf16, f16, f32; other dtypes raise) and promoted to a common dtype; the output
dtype is preferred_element_type or that dtype. `precision` is accepted for compatibility:
products are always taken on the inputs as given, with float32 accumulation.
"""

from __future__ import annotations

import jax.numpy as jnp

from moe_xla.primitives import _checks
from moe_xla.primitives.gmm import gmm


def ragged_dot(lhs, rhs, group_sizes, precision=None, preferred_element_type=None, group_offset=None):
    """Same signature and semantics as jax.lax.ragged_dot."""
    del precision
    if group_offset is not None:
        raise NotImplementedError("ragged_dot: group_offset is not supported (nor by jax.lax.ragged_dot)")
    lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
    group_sizes = jnp.asarray(group_sizes)
    if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise TypeError(f"ragged_dot: expected integer group_sizes, got {group_sizes.dtype}")
    dtype = jnp.promote_types(lhs.dtype, rhs.dtype)
    if dtype not in _checks.FLOAT_DTYPES:
        raise TypeError(f"ragged_dot: expected floating operands (bfloat16, float16, float32), got {lhs.dtype} "
                        f"lhs and {rhs.dtype} rhs (jax.lax.ragged_dot computes other dtypes)")
    return gmm(lhs.astype(dtype), rhs.astype(dtype), group_sizes.astype(jnp.int32),
               preferred_element_type=preferred_element_type or dtype)
