"""unpermute: the weighted combine of MoE expert outputs (definition in common/routing.h).

    y[t] = sum_{j < k} weights[t, j] * y_sorted[row_map[t*k + j]]

y_sorted [R, H], row_map [T*k] int32, weights [T, k] float32 -> y [T, H] (dtype of
y_sorted), accumulated in float32 in j order, each product rounded before it is added:
bitwise reproducible. weights=None with top_k=k: every weight 1, the plain sum of each
token's k rows (the same bits as weights of ones: 1 * v is exact), with no [T, k] array of
ones to fill (the form of every sum of rows with weights 1 in the library).
Entries of row_map outside [0, R) contribute 0. R = T*k after
permute; any R otherwise (the EP layer sums rows of its padded buffers with it, its
slots as the row map, and ep_expand's transpose is it with weights 1).

unpermute is bilinear in (y_sorted, weights):
    d y_sorted[r] = sum_{(t, j): row_map[t*k + j] = r} weights[t, j] * ct[t]   (no entry names r: 0)
    d weights[t, j] = <ct[t], y_sorted[row_map[t*k + j]]>
Both are deterministic (no scatter-add). d y_sorted holds for any row_map: the entries are
sorted stably by row and each row's run summed by a segmented scan (_rows.sum_rows_into).
unique_rows=True promises that row_map names each row at most once, as permute's row_map
does; d y_sorted is then one gather_rows through the inverse of row_map
(_expanded), and a row named twice would get only one of its terms. That
path makes products weights[t, j] * ct[t] of magnitude <= 2^-126 signed zeros
(gather_rows' rule, the same on every platform; without weights it copies ct's rows as
they are); the general path keeps what XLA computes.
The inverse is one XLA scatter, unless the caller passes it as row_pairs [R] int32 (the
entry t*k + j naming row r, an index outside [0, T*k) where none does: permute's
row_pairs, the EP transports' send-slot sources), a promise that implies unique_rows and
spares the scatter. The forward does not read it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import ad, batching

import moe_xla._rows as _rows
from moe_xla.primitives import _ad, _batching, _checks, _impl, _lowering, _sharding
from moe_xla.primitives.gather_rows import gather_rows

unpermute_p = Primitive("moe_xla_unpermute")


def unpermute(y_sorted, row_map, weights=None, *, top_k=None, unique_rows=False, row_pairs=None):
    """Weighted combine of the k expert outputs of every token:
    y[t] = sum_j weights[t, j] * y_sorted[row_map[t*k + j]]. See the module docstring;
    weights=None (every weight 1) takes k as top_k. unique_rows=True (a promise that
    row_map names each row at most once) makes the gradient in y_sorted one gather;
    row_pairs (row_map's inverse, a promise that implies unique_rows) makes it that
    gather without computing the inverse."""
    unique_rows = _checks.static_bool("unpermute", "unique_rows", unique_rows)
    if (weights is None) == (top_k is None):
        raise ValueError(f"unpermute: expected either weights [T, k] or top_k=k (every weight 1), got "
                         f"weights {'None' if weights is None else jax.typeof(weights).str_short()} and "
                         f"top_k={top_k!r}")
    if top_k is not None:
        top_k = _checks.positive_int("unpermute", "top_k", top_k)
    extra = () if row_pairs is None else (row_pairs,)
    operands = (y_sorted, row_map) if weights is None else (y_sorted, row_map, weights)
    return unpermute_p.bind(*operands, *extra, unique_rows=unique_rows or bool(extra), has_row_pairs=bool(extra),
                            unit_k=top_k)


def _split(args, unit_k):
    """(y_sorted, row_map, weights or None (every weight 1), row_pairs tuple) of the operands."""
    if unit_k is None:
        return args[0], args[1], args[2], tuple(args[3:])
    return args[0], args[1], None, tuple(args[2:])


def _abstract_eval(*args, unique_rows, has_row_pairs, unit_k):
    y_sorted, row_map, weights, row_pairs = _split(args, unit_k)
    _checks.rank("unpermute", "y_sorted", y_sorted, 2, "[T*k, H]")
    _checks.float_dtype("unpermute", "y_sorted", y_sorted)
    _checks.int32("unpermute", "row_map", row_map)
    if weights is None:
        _checks.rank("unpermute", "row_map", row_map, 1, "[T*k]")
        if row_map.shape[0] % unit_k:
            raise ValueError(f"unpermute: expected row_map of shape (T*k,), a multiple of top_k={unit_k}, got "
                             f"{tuple(row_map.shape)}")
        tokens = row_map.shape[0] // unit_k
    else:
        _checks.rank("unpermute", "weights", weights, 2, "[T, k]")
        if jnp.dtype(weights.dtype) != jnp.float32:
            raise TypeError(f"unpermute: expected float32 weights, got {weights.dtype}")
        rows = weights.shape[0] * weights.shape[1]
        if tuple(row_map.shape) != (rows,):
            raise ValueError(f"unpermute: expected row_map of shape ({rows},) (T*k of weights [T, k]), "
                             f"got {tuple(row_map.shape)}")
        tokens = weights.shape[0]
    for pairs in row_pairs:
        _checks.rank("unpermute", "row_pairs", pairs, 1, "[R]")
        _checks.int32("unpermute", "row_pairs", pairs)
        _checks.dim("unpermute", "row_pairs.shape[0] (R of y_sorted [R, H])", y_sorted.shape[0], pairs.shape[0])
    return jax.core.ShapedArray((tokens, y_sorted.shape[1]), y_sorted.dtype)


def _expanded(rows, slots, weights, row_pairs, *, num_pairs: int):
    """_rows.sum_rows_into(rows, slots, weights) for slots naming each row at most once, as
    one gather_rows through the inverse of slots (row_pairs, or computed; a row named twice
    gets one of its terms); weights None: every weight 1, a gather without factors."""
    if row_pairs:
        src, factor = _rows.pair_sources(row_pairs[0], slots.shape, weights)
    else:
        src, factor = _rows.expansion_sources(slots, weights, num_pairs=num_pairs)
    return gather_rows(rows, src) if factor is None else gather_rows(rows, src, factor.astype(jnp.float32))


def _jvp(primals, tangents, *, unit_k, **params):
    if unit_k is not None:  # linear in y_sorted
        out = unpermute_p.bind(*primals, unit_k=unit_k, **params)
        if type(tangents[0]) is ad.Zero:
            return out, _ad.zero_tangent(out)
        return out, unpermute_p.bind(tangents[0], *primals[1:], unit_k=unit_k, **params)
    return _ad.bilinear_jvp(unpermute_p, 0, 2)(primals, tangents, unit_k=unit_k, **params)


def _transpose(ct, *args, unique_rows, has_row_pairs, unit_k):
    y_sorted, row_map, weights, row_pairs = _split(args, unit_k)
    if ad.is_undefined_primal(row_map):
        raise ValueError("unpermute: row_map is integer and cannot be differentiated")
    nones = (None,) * (unit_k is None) + (None,) * has_row_pairs  # weights when given, then row_pairs
    if weights is None:
        t, k = row_map.shape[0] // unit_k, unit_k
    else:
        t, k = (weights.aval if ad.is_undefined_primal(weights) else weights).shape
    if ad.is_undefined_primal(y_sorted):
        if type(ct) is ad.Zero:
            return ad.Zero(y_sorted.aval), None, *nones
        slots, num_rows = row_map.reshape(t, k), y_sorted.aval.shape[0]
        if unique_rows:
            d_rows = _expanded(ct, slots, weights, row_pairs, num_pairs=num_rows)
        else:
            w = jnp.ones(slots.shape, jnp.float32) if weights is None else weights
            d_rows = _rows.sum_rows_into(ct, slots, w, num_rows=num_rows)
        return d_rows.astype(y_sorted.aval.dtype), None, *nones
    pairs_ct = (None,) * has_row_pairs  # integer: no cotangent
    if type(ct) is ad.Zero:
        return None, None, ad.Zero(weights.aval), *pairs_ct
    return None, None, _rows.row_dots(ct, y_sorted, row_map.reshape(t, k)).astype(weights.aval.dtype), *pairs_ct


def _batch(args, dims, *, unique_rows, has_row_pairs, unit_k):
    args, _ = _batching.all_to_front(args, dims)
    y_sorted, row_map, weights, row_pairs = _split(args, unit_k)
    b, rows = y_sorted.shape[:2]
    t, k = (row_map.shape[1] // unit_k, unit_k) if weights is None else weights.shape[1:]
    folded = _batching.folded_rows(row_map, rows)
    # Element b's entries t*k + j become b*T*k + t*k + j, as its tokens fold to b*T + t.
    folded_pairs = [_batching.folded_rows(pairs, t * k).reshape(b * rows) for pairs in row_pairs]
    h = y_sorted.shape[-1]
    given = () if weights is None else (weights.reshape(b * t, k),)
    # Folding keeps each row named as often as before (rows naming no row all go past the stack).
    y = unpermute_p.bind(y_sorted.reshape(b * rows, h), folded.reshape(b * t * k), *given, *folded_pairs,
                         unique_rows=unique_rows, has_row_pairs=has_row_pairs, unit_k=unit_k)
    return y.reshape(b, t, h), 0


_impl.def_jitted_impl(unpermute_p)
unpermute_p.def_abstract_eval(_abstract_eval)
ad.primitive_jvps[unpermute_p] = _jvp
ad.primitive_transposes[unpermute_p] = _transpose
batching.primitive_batchers[unpermute_p] = _batch
_lowering.register(unpermute_p, "unpermute", lambda **_: {}, sharding=_sharding.UNPERMUTE,
                   kernel_operands=lambda unit_k, **_: 2 + (unit_k is None))  # row_pairs serves the transpose alone
