"""ep_gather_sum: the EP layer's weighted sum of (row, local expert) results back into rows.

    out[q] = sum_j weights[q, j] * values[slots[q, j]]      in j order; out [N, H]

values [num_pairs, H]; slots [N, mult] int32 (an index outside [0, num_pairs) names no
row and adds 0); weights [N, mult] float32. Accumulated in float32 (or the inputs' wider
dtype), each product rounded before it is added, returned in values' dtype; deterministic.
Lowered, on every platform, as unpermute's kernel (y_sorted = values of any row count,
row_map = slots flattened); float64 values through jnp (_rows.gather_sum_rows).

Bilinear in (values, weights), and the transpose of ep_expand:
    d values = ep_expand(ct, slots, weights, num_pairs)
    d weights[q, j] = <ct[q], values[slots[q, j]]>
ep_expand's transpose, an ep_gather_sum (see ep_expand.py), is registered here too, so
that ep_expand.py need not import this module.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from moe_xla._rows import gather_sum_rows, row_dots
from moe_xla.primitives import _ad
from moe_xla.primitives._batching import all_to_front
from moe_xla.primitives.ep_expand import KERNEL_DTYPES, expand, expand_p, folded_slots
from moe_xla.primitives.unpermute import unpermute_p

gather_sum_p = Primitive("moe_xla_ep_gather_sum")


def _batch(args, dims):
    (values, slots, weights), size = all_to_front(args, dims)
    n, h = slots.shape[1], values.shape[-1]
    out = gather_sum_p.bind(values.reshape(size * values.shape[1], h), folded_slots(slots, values.shape[1]),
                            weights.reshape(size * n, weights.shape[-1]))
    return out.reshape(size, n, h), 0


def _bilinear_transpose(data_transpose, weights_transpose):
    """The transpose rule of prim(data, slots, weights), linear in data and in weights (or
    of prim(data, slots), linear in data: weights None below):
    data_transpose(ct, slots, weights, data_aval) and weights_transpose(ct, data, slots)."""

    def transpose(ct, data, slots, *weights, **params):
        rest = (None,) * len(weights)
        if ad.is_undefined_primal(data):
            w = weights[0] if weights else None
            d = ad.Zero(data.aval) if type(ct) is ad.Zero else data_transpose(ct, slots, w, data.aval)
            return (d, None) + rest
        d = ad.Zero(weights[0].aval) if type(ct) is ad.Zero else weights_transpose(ct, data, slots)
        return None, None, d

    return transpose


def _gather_sum(values, slots, weights):
    """The lowering (module docstring): unpermute's kernel with row_map = slots flattened."""
    if values.dtype not in KERNEL_DTYPES:
        return gather_sum_rows(values, slots, weights)
    return unpermute_p.bind(values, slots.reshape(-1), weights, unique_rows=False)


gather_sum_p.def_impl(_gather_sum)
gather_sum_p.def_abstract_eval(lambda values, slots, weights: jax.core.ShapedArray(
    (slots.shape[0], values.shape[1]), values.dtype))
ad.primitive_jvps[gather_sum_p] = _ad.bilinear_jvp(gather_sum_p, 0, 2)
batching.primitive_batchers[gather_sum_p] = _batch
mlir.register_lowering(gather_sum_p, mlir.lower_fun(_gather_sum, multiple_results=False))
ad.primitive_transposes[gather_sum_p] = _bilinear_transpose(
    lambda ct, slots, w, aval: expand(ct, slots, w, num_pairs=aval.shape[0]),
    lambda ct, values, slots: row_dots(ct, values, slots))
ad.primitive_transposes[expand_p] = _bilinear_transpose(
    lambda ct, slots, w, aval: gather_sum_p.bind(ct, slots, jnp.ones(slots.shape, jnp.float32) if w is None else w),
    lambda ct, rows, slots: row_dots(rows, ct, slots))
