"""Pure-jnp definitions of every moe_xla primitive: the spec and the test oracle.

These are also the lowering used when MOE_XLA_IMPL=reference. They favour clarity over
speed and memory.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def group_ends(group_sizes, m: int):
    """Exclusive end row of each group after clamping (common/grouped_gemm.h):
    size'_g = clamp(size_g, 0, m - start_g), so end_g = min(sum_{h<=g} max(size_h, 0), m)."""
    sizes = jnp.clip(group_sizes.astype(jnp.int32), 0, m)
    return jnp.minimum(jnp.cumsum(sizes, dtype=jnp.int32), m)


def clamped_group_sizes(group_sizes, m: int):
    """Group sizes after clamping to the m rows: they sum to at most m."""
    ends = group_ends(group_sizes, m)
    return jnp.diff(ends, prepend=jnp.zeros((1,), ends.dtype))


def clamped_group_sizes_batched(group_sizes, m: int):
    """clamped_group_sizes over the last axis of [..., G] group sizes."""
    return jnp.vectorize(lambda gs: clamped_group_sizes(gs, m), signature="(g)->(g)")(group_sizes)


def row_groups(group_sizes, m: int):
    """Group index of each of the m rows; G for rows past the last group."""
    return jnp.searchsorted(group_ends(group_sizes, m), jnp.arange(m, dtype=jnp.int32), side="right")


def gmm(lhs, rhs, group_sizes, *, transpose_rhs=False, preferred_element_type=None):
    """out[rows of g] = lhs[rows of g] @ rhs[g] (rhs[g]^T if transpose_rhs); other rows 0.

    lhs [M, K], rhs [G, K, N] ([G, N, K] if transpose_rhs), group_sizes [G] -> [M, N].
    """
    out_dtype = preferred_element_type or lhs.dtype
    m = lhs.shape[0]
    groups = row_groups(group_sizes, m)
    rhs32 = rhs.astype(jnp.float32)
    if transpose_rhs:
        rhs32 = jnp.swapaxes(rhs32, 1, 2)
    lhs32 = lhs.astype(jnp.float32)

    def add_group(acc, g):
        mask = (groups == g)[:, None]
        return acc + jnp.where(mask, jnp.dot(lhs32, rhs32[g], precision="highest"), 0.0), None

    init = jnp.zeros((m, rhs32.shape[2]), jnp.float32)
    out, _ = jax.lax.scan(add_group, init, jnp.arange(rhs.shape[0]))
    return out.astype(out_dtype)


def tgmm(lhs, rhs, group_sizes, *, preferred_element_type=None):
    """out[g] = lhs[rows of g]^T @ rhs[rows of g]; zero for empty groups.

    lhs [M, K], rhs [M, N], group_sizes [G] -> [G, K, N].
    """
    out_dtype = preferred_element_type or lhs.dtype
    m = lhs.shape[0]
    groups = row_groups(group_sizes, m)
    lhs32, rhs32 = lhs.astype(jnp.float32), rhs.astype(jnp.float32)

    def one_group(g):
        masked = jnp.where((groups == g)[:, None], lhs32, 0.0)
        return jnp.dot(masked.T, rhs32, precision="highest")

    return jax.lax.map(one_group, jnp.arange(group_sizes.shape[0])).astype(out_dtype)
