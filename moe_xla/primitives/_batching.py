"""Folding a vmapped batch of grouped problems into one grouped problem."""

from __future__ import annotations

import jax.numpy as jnp

from moe_xla import reference


def to_front(x, bdim, size: int):
    """Moves the batch dimension of x to 0, broadcasting unbatched operands."""
    if bdim is None:
        return jnp.broadcast_to(x, (size,) + x.shape)
    return jnp.moveaxis(x, bdim, 0)


def folded_group_sizes(group_sizes, m: int):
    """[B, G] group sizes over B stacked blocks of m rows -> [B * (G + 1)] sizes.

    Each block's sizes are clamped to its m rows and followed by a spacer group that
    covers the block's remaining rows, so block b's groups start at row b * m.
    """
    sizes = reference.clamped_group_sizes_batched(group_sizes, m)
    spacer = m - jnp.sum(sizes, axis=1, keepdims=True)
    return jnp.concatenate([sizes, spacer], axis=1).reshape(-1).astype(jnp.int32)
