"""Batching rules' shared steps: batch dimensions to the front, and folding a vmapped batch
of grouped problems (or of row indices) into one."""

from __future__ import annotations

import jax.numpy as jnp

import moe_xla._rows as _rows


def batched_to_front(args, dims):
    """(args with their batch dimension first, unbatched ones as they are; the batch size)."""
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    return [a if d is None else jnp.moveaxis(a, d, 0) for a, d in zip(args, dims)], size


def all_to_front(args, dims):
    """(args with their batch dimension first, unbatched ones broadcast; the batch size)."""
    args, size = batched_to_front(args, dims)
    return [a if d is not None else jnp.broadcast_to(a, (size,) + a.shape) for a, d in zip(args, dims)], size


def clamped_group_sizes(group_sizes, m: int):
    """[..., G] group sizes clamped to m rows as the kernels clamp them (common/grouped_gemm.h):
    size'_g = clamp(size_g, 0, m - start_g) with start_g = min(sum_{h<g} max(size_h, 0), m).
    Sizes are clipped to [0, m] before summing, so the int32 sums stay within G * m."""
    nonneg = jnp.clip(group_sizes, 0, m)
    starts = jnp.minimum(jnp.cumsum(nonneg, axis=-1) - nonneg, m)
    return jnp.clip(group_sizes, 0, m - starts)


def folded_group_sizes(group_sizes, m: int):
    """[B, G] group sizes over B stacked blocks of m rows -> [B * (G + 1)] sizes.

    Each block's sizes are clamped to its m rows and followed by a spacer group that
    covers the block's remaining rows, so block b's groups start at row b * m.
    """
    sizes = clamped_group_sizes(group_sizes, m)
    spacer = m - jnp.sum(sizes, axis=1, keepdims=True)
    return jnp.concatenate([sizes, spacer], axis=1).reshape(-1).astype(jnp.int32)


def folded_rows(idx, per_batch: int):
    """[B, ...] row indices into per-batch blocks of per_batch rows -> indices into the B
    blocks stacked (batch b's row i -> b * per_batch + i); indices outside [0, per_batch),
    which name no row, go to B * per_batch, past every block."""
    b = idx.shape[0]
    offset = (jnp.arange(b, dtype=idx.dtype) * per_batch).reshape((b,) + (1,) * (idx.ndim - 1))
    return jnp.where(_rows.names_row(idx, per_batch), idx + offset, b * per_batch)


def with_spacer_groups(rhs):
    """[B, G, ...] per-group operands -> [B * (G + 1), ...]: each batch element's groups and
    an all-zero one for its spacer group (folded_group_sizes)."""
    b, g = rhs.shape[:2]
    rhs = jnp.concatenate([rhs, jnp.zeros((b, 1) + rhs.shape[2:], rhs.dtype)], axis=1)
    return rhs.reshape((b * (g + 1),) + rhs.shape[2:])


def fold_gather(args, dims):
    """The operands (x [T, K], src [M], w [G, ...], group_sizes [G], *rest) of a gather
    product (gather_gmm, gather_gmm_activate) vmapped along `dims`, as one unbatched call
    over B stacked problems: (x, src [B * M], w [B * (G + 1), ...] with spacer groups,
    folded group sizes [B * (G + 1)], rest [B, ...], B, M, T or None). A batched x is
    stacked to [B * T, K] (T returned) and src folded into the stacked tokens (entries that
    name no token go past them); an unbatched x is read by every element as it is."""
    x_batched = dims[0] is not None
    args, b = batched_to_front(args, dims)
    # x is stacked only where it is batched; every other operand gets the batch dimension.
    x, src, w, group_sizes, *rest = [a if d is not None or i == 0 else jnp.broadcast_to(a, (b,) + a.shape)
                                     for i, (a, d) in enumerate(zip(args, dims))]
    m = src.shape[1]
    t = None
    if x_batched:
        t = x.shape[1]
        x = x.reshape(b * t, x.shape[2])
        src = folded_rows(src, t)
    return (x, src.reshape(b * m), with_spacer_groups(w), folded_group_sizes(group_sizes, m), rest, b, m, t)


def zero_spacer_rows(out, folded, b: int, m: int):
    """The [B * m, N] output of a folded grouped product as [B, m, N], with each element's
    rows past its groups (its spacer group's, folded_group_sizes) set to exactly 0: the
    spacer's zero operand alone gives NaN for inf or NaN rows (inf @ 0)."""
    out = out.reshape(b, m, out.shape[-1])
    covered = m - folded.reshape(b, -1)[:, -1:]  # rows before the spacer group
    return jnp.where((jnp.arange(m) < covered)[..., None], out, jnp.zeros((), out.dtype))
