"""unpermute: the weighted combine of MoE expert outputs (definition in common/routing.h).

    y[t] = sum_{j < k} weights[t, j] * y_sorted[row_map[t*k + j]]

y_sorted [T*k, H], row_map [T*k] int32, weights [T, k] float32 -> y [T, H] (dtype of
y_sorted), accumulated in float32 in j order: bitwise reproducible. Entries of row_map
outside [0, T*k) contribute 0.

unpermute is bilinear in (y_sorted, weights):
    d y_sorted[row_map[t*k + j]] = weights[t, j] * ct[t]     (rows no entry names: 0)
    d weights[t, j] = <ct[t], y_sorted[row_map[t*k + j]]>
d y_sorted is a gather through the inverse of row_map, so it holds where each row is named
at most once (permute's row_map names each exactly once); a row named twice gets one of
its two terms.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import ad, batching

from moe_xla import _rows, reference
from moe_xla.primitives import _ad, _batching, _checks, _lowering, _sharding

unpermute_p = Primitive("moe_xla_unpermute")


def unpermute(y_sorted, row_map, weights):
    """Weighted combine of the k expert outputs of every token. See the module docstring."""
    return unpermute_p.bind(y_sorted, row_map, weights)


def _abstract_eval(y_sorted, row_map, weights):
    _checks.rank("unpermute", "y_sorted", y_sorted, 2, "[T*k, H]")
    _checks.rank("unpermute", "weights", weights, 2, "[T, k]")
    _checks.float_dtype("unpermute", "y_sorted", y_sorted)
    if jnp.dtype(weights.dtype) != jnp.float32:
        raise TypeError(f"unpermute: expected float32 weights, got {weights.dtype}")
    if jnp.dtype(row_map.dtype) != jnp.int32:
        raise TypeError(f"unpermute: expected int32 row_map, got {row_map.dtype}")
    rows = weights.shape[0] * weights.shape[1]
    if tuple(row_map.shape) != (rows,):
        raise ValueError(f"unpermute: expected row_map of shape ({rows},) (T*k of weights [T, k]), "
                         f"got {tuple(row_map.shape)}")
    _checks.dim("unpermute", "y_sorted.shape[0] (T*k of weights [T, k])", rows, y_sorted.shape[0])
    return jax.core.ShapedArray((weights.shape[0], y_sorted.shape[1]), y_sorted.dtype)


def _transpose(ct, y_sorted, row_map, weights):
    if ad.is_undefined_primal(row_map):
        raise ValueError("unpermute: row_map is integer and cannot be differentiated")
    t, k = (weights.aval if ad.is_undefined_primal(weights) else weights).shape
    if ad.is_undefined_primal(y_sorted):
        if type(ct) is ad.Zero:
            return ad.Zero(y_sorted.aval), None, None
        d_rows = _rows.expand_rows(ct, row_map.reshape(t, k), weights, num_pairs=y_sorted.aval.shape[0])
        return d_rows.astype(y_sorted.aval.dtype), None, None
    if type(ct) is ad.Zero:
        return None, None, ad.Zero(weights.aval)
    return None, None, _rows.row_dots(ct, y_sorted, row_map.reshape(t, k)).astype(weights.aval.dtype)


def _batch(args, dims):
    (y_sorted, row_map, weights), _ = _batching.all_to_front(args, dims)
    b, t, k = weights.shape
    rows = t * k
    folded = _batching.folded_rows(row_map, rows)
    h = y_sorted.shape[-1]
    y = unpermute_p.bind(y_sorted.reshape(b * rows, h), folded.reshape(b * rows), weights.reshape(b * t, k))
    return y.reshape(b, t, h), 0


unpermute_p.def_impl(lambda *args, **params: jax.jit(lambda *a: unpermute_p.bind(*a, **params))(*args))
unpermute_p.def_abstract_eval(_abstract_eval)
ad.primitive_jvps[unpermute_p] = _ad.bilinear_jvp(unpermute_p, 0, 2)
ad.primitive_transposes[unpermute_p] = _transpose
batching.primitive_batchers[unpermute_p] = _batch
_lowering.register(unpermute_p, "unpermute", reference.unpermute, lambda **_: {},
                   sharding=_sharding.UNPERMUTE)
