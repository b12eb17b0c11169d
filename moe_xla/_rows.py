"""Row gathers through index arrays in which an index outside [0, R) names no row.

With slots [N, mult] naming rows of a [R, H] array, the functions below are bilinear in
(data, weights), accumulated in float32 (or the inputs' wider dtype):
    sum_rows_into(rows, slots, w)[r] = sum_{(q, j): slots[q, j] = r} w[q, j] rows[q]
    expand_rows(rows, slots, w) = sum_rows_into(rows, slots, w) where each row is named
        at most once: then row slots[q, j] is w[q, j] rows[q], one gather.
Both are transposes of unpermute's sum, y[q] = sum_j w[q, j] values[slots[q, j]] (j
order), in values. Neither needs a scatter-add, so both are deterministic.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def names_row(idx, num_rows: int):
    """Whether each index names one of num_rows rows: 0 <= idx < num_rows."""
    return (idx >= 0) & (idx < num_rows)


def row_weights(row_map, weights, num_rows: int):
    """omega [num_rows]: omega[row_map[t*k + j]] = weights[t, j], 0 for rows no entry names
    (row_map names each row at most once). A scatter of distinct places (entries naming no
    row are dropped), so that its transpose, the weights' cotangent, is a gather: no
    scatter-add."""
    place = jnp.where(names_row(row_map, num_rows), row_map, num_rows)
    return jnp.zeros((num_rows,), weights.dtype).at[place].set(weights.reshape(-1), mode="drop", unique_indices=True)


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
    # One scatter: rows it does not reach keep -1.
    target = jnp.where(names_row(idx, num_rows), idx, num_rows + jnp.arange(n, dtype=idx.dtype))
    src = jnp.full((num_rows,), -1, jnp.int32).at[target].set(jnp.arange(n, dtype=jnp.int32), mode="drop",
                                                              unique_indices=True)
    return jnp.maximum(src, 0), src >= 0


def acc_dtype(dtype):
    """The accumulation dtype: float32, or wider inputs' own."""
    return jnp.promote_types(dtype, jnp.float32)


def pair_sources(pairs, shape, weights=None):
    """(src, factor), both of pairs' shape, for places that hold the (q, j) pairs of slots of
    `shape` (N, mult), given as pairs[r] = q * mult + j, or an index outside [0, N * mult)
    where r holds none: src[r] = q (-1 for none) and factor[r] = weights[q, j] (0 for none).
    Without weights, factor is None. Gathers only."""
    n, mult = shape
    named = names_row(pairs, n * mult)
    pair = jnp.where(named, pairs, 0)
    src = jnp.where(named, pair // mult, -1)
    if weights is None:
        return src, None
    if n * mult == 0:  # no pairs: nothing to gather the weights from
        return src, jnp.zeros(pairs.shape, weights.dtype)
    return src, jnp.where(named, weights.reshape(-1)[pair], 0)


def expansion_sources(slots, weights=None, *, num_pairs: int):
    """(src, factor), both [num_pairs]: expand_rows(rows, slots, weights)[r] is factor[r] *
    rows[src[r]], or 0 where src[r] = -1 (no slot names r; factor 0 there). Without
    weights, factor is None: the places' sources alone. The slots' inverse is one scatter;
    pair_sources reads the same from an inverse the caller already has."""
    pair, named = inverse_rows(slots.reshape(-1), num_pairs)
    return pair_sources(jnp.where(named, pair, -1), slots.shape, weights)


def expand_rows(rows, slots, weights, *, num_pairs: int):
    """[num_pairs, H]: row slots[q, j] is weights[q, j] * rows[q]; rows no slot names are 0.
    slots must name each row at most once (a row named twice gets one of its terms)."""
    src, factor = expansion_sources(slots, weights, num_pairs=num_pairs)
    v = factor[:, None] * rows[jnp.maximum(src, 0)].astype(acc_dtype(rows.dtype))
    return jnp.where((src >= 0)[:, None], v, 0).astype(rows.dtype)


def sum_rows_into(rows, slots, weights, *, num_rows: int):
    """[num_rows, H]: row r is sum_{(q, j): slots[q, j] = r} weights[q, j] * rows[q], for any
    slots (a row named n times gets n terms, rows no slot names are 0).

    Deterministic without a scatter-add: the (q, j) pairs are sorted stably by slot, a
    segmented scan sums each run of equal slots (a tree of adds fixed by the shapes), and
    row r takes the sum at the end of its run through one gather.
    """
    n, mult = slots.shape
    dtype = acc_dtype(rows.dtype)
    if n * mult == 0:
        return jnp.zeros((num_rows,) + rows.shape[1:], rows.dtype)
    flat = slots.reshape(-1)
    named = names_row(flat, num_rows)
    key = jnp.where(named, flat, num_rows)  # pairs naming no row sort last, in a run of their own
    key, order = jax.lax.sort_key_val(key, jnp.arange(n * mult, dtype=key.dtype), is_stable=True)
    w = jnp.where(named, weights.reshape(-1), 0)[order]
    terms = w[:, None] * rows[order // mult].astype(dtype)
    first = jnp.concatenate([jnp.ones((1,), bool), key[1:] != key[:-1]])
    last = jnp.concatenate([key[1:] != key[:-1], jnp.ones((1,), bool)])

    def add_in_run(a, b):  # (starts a run, partial sum): associative
        return a[0] | b[0], jnp.where(b[0][:, None], b[1], a[1] + b[1])

    sums = jax.lax.associative_scan(add_in_run, (first, terms))[1]
    src, summed = inverse_rows(jnp.where(last, key, num_rows), num_rows)
    return jnp.where(summed[:, None], sums[src], 0).astype(rows.dtype)


def row_dots(a, b, slots):
    """[N, mult]: <a[q], b[slots[q, j]]> (0 for slots naming no row): the weights' cotangent."""
    a = a.astype(acc_dtype(a.dtype))
    return jnp.stack([jnp.sum(a * take_rows(b, slots[:, j], a.dtype), axis=-1) for j in range(slots.shape[1])],
                     axis=-1)
