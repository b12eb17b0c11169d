"""ep_gather_sum: the EP layer's weighted sum of (row, local expert) results back into rows.

    out[q] = sum_j weights[q, j] * values[slots[q, j]]      in j order; out [N, H]

values [num_pairs, H]; slots [N, mult] int32 (an index outside [0, num_pairs) names no
row and adds 0); weights [N, mult] float32. Accumulated in float32 (or the inputs' wider
dtype), returned in values' dtype.

Bilinear in (values, weights), and the transpose of ep_expand:
    d values = ep_expand(ct, slots, weights, num_pairs)
    d weights[q, j] = <ct[q], values[slots[q, j]]>
Lowered through jnp (_rows.gather_sum_rows) on every platform; deterministic.
"""

from __future__ import annotations

import jax
from jax.interpreters import batching, mlir

from moe_xla._rows import gather_sum_rows, row_dots
from moe_xla.primitives._batching import all_to_front
from moe_xla.primitives._ep_pair import expand_p, folded_slots, gather_sum_p, register_bilinear_rules


def _batch(args, dims):
    (values, slots, weights), size = all_to_front(args, dims)
    n, h = slots.shape[1], values.shape[-1]
    out = gather_sum_p.bind(values.reshape(size * values.shape[1], h), folded_slots(slots, values.shape[1]),
                            weights.reshape(size * n, weights.shape[-1]))
    return out.reshape(size, n, h), 0


gather_sum_p.def_impl(gather_sum_rows)
gather_sum_p.def_abstract_eval(lambda values, slots, weights: jax.core.ShapedArray(
    (slots.shape[0], values.shape[1]), values.dtype))
batching.primitive_batchers[gather_sum_p] = _batch
mlir.register_lowering(gather_sum_p, mlir.lower_fun(gather_sum_rows, multiple_results=False))
register_bilinear_rules(gather_sum_p, lambda ct, slots, w, aval: expand_p.bind(ct, slots, w, num_pairs=aval.shape[0]),
                        lambda ct, values, slots: row_dots(ct, values, slots))
