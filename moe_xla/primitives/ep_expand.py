"""ep_expand: the EP layer's expansion of received rows to their (row, local expert) pairs.

    out[slots[q, j]] = weights[q, j] * rows[q]        out [num_pairs, H]; pairs no slot names: 0

rows [N, H]; slots [N, mult] int32, naming each of the num_pairs output rows at most once
(an index outside [0, num_pairs) names none); weights [N, mult] float32. Accumulated in
float32 (or the inputs' wider dtype), returned in rows' dtype.

Bilinear in (rows, weights), and the transpose of ep_gather_sum:
    d rows = ep_gather_sum(ct, slots, weights)
    d weights[q, j] = <rows[q], ct[slots[q, j]]>
Lowered through jnp (_rows.expand_rows) on every platform; a gather, no scatter-add, so
deterministic.
"""

from __future__ import annotations

import jax
from jax.interpreters import batching, mlir

from moe_xla._rows import expand_rows, row_dots
from moe_xla.primitives._batching import all_to_front
from moe_xla.primitives._ep_pair import expand_p, folded_slots, gather_sum_p, register_bilinear_rules


def _batch(args, dims, *, num_pairs):
    (rows, slots, weights), size = all_to_front(args, dims)
    n, h = slots.shape[1], rows.shape[-1]
    out = expand_p.bind(rows.reshape(size * n, h), folded_slots(slots, num_pairs),
                        weights.reshape(size * n, weights.shape[-1]), num_pairs=size * num_pairs)
    return out.reshape(size, num_pairs, h), 0


expand_p.def_impl(expand_rows)
expand_p.def_abstract_eval(lambda rows, slots, weights, *, num_pairs: jax.core.ShapedArray(
    (num_pairs, rows.shape[1]), rows.dtype))
batching.primitive_batchers[expand_p] = _batch
mlir.register_lowering(expand_p, mlir.lower_fun(expand_rows, multiple_results=False))
register_bilinear_rules(expand_p, lambda ct, slots, w, aval: gather_sum_p.bind(ct, slots, w),
                        lambda ct, rows, slots: row_dots(rows, ct, slots))
