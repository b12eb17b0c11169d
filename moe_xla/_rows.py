"""Row gathers through index arrays in which an index outside [0, R) names no row."""

from __future__ import annotations

import jax.numpy as jnp


def names_row(idx, num_rows: int):
    """Whether each index names one of num_rows rows: 0 <= idx < num_rows."""
    return (idx >= 0) & (idx < num_rows)


def take_rows(values, idx, dtype):
    """values[idx] ([..., H] rows of values [R, H]) as dtype, 0 where idx is outside [0, R)."""
    n = values.shape[0]
    if n == 0:
        return jnp.zeros(idx.shape + values.shape[1:], dtype)
    return jnp.where(names_row(idx, n)[..., None], values[jnp.clip(idx, 0, n - 1)].astype(dtype), 0)


def inverse_rows(idx, num_rows: int):
    """The inverse of idx [n], which names each of num_rows rows at most once: (src, named),
    both [num_rows], with idx[src[r]] = r where named[r]; entries outside [0, num_rows) name
    no row. A gather through src moves what a scatter through idx would, deterministically."""
    n = idx.shape[0]
    # Entries naming no row go to distinct places past the rows, so the indices stay unique.
    target = jnp.where(names_row(idx, num_rows), idx, num_rows + jnp.arange(n, dtype=idx.dtype))
    src = jnp.zeros((num_rows,), jnp.int32).at[target].set(jnp.arange(n, dtype=jnp.int32), mode="drop",
                                                           unique_indices=True)
    return src, jnp.zeros((num_rows,), bool).at[target].set(True, mode="drop", unique_indices=True)
