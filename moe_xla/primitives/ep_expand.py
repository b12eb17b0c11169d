"""ep_expand: the EP layer's expansion of received rows to their (row, local expert) pairs.

    out[slots[q, j]] = weights[q, j] * rows[q]        out [num_pairs, H]; pairs no slot names: 0

rows [N, H]; slots [N, mult] int32, naming each of the num_pairs output rows at most once
(an index outside [0, num_pairs) names none); weights [N, mult] float32. Accumulated in
float32 (or the inputs' wider dtype), returned in rows' dtype. Lowered through jnp
(_rows.expand_rows) on every platform: a gather, no scatter-add, so deterministic.

Bilinear in (rows, weights), and the transpose of ep_gather_sum:
    d rows = ep_gather_sum(ct, slots, weights)
    d weights[q, j] = <rows[q], ct[slots[q, j]]>
That transpose is registered in ep_gather_sum.py: ep_gather_sum's transpose is an
ep_expand, so one of the two files holds both directions and imports the other.
"""

from __future__ import annotations

import jax
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from moe_xla._rows import expand_rows
from moe_xla.primitives import _ad
from moe_xla.primitives._batching import all_to_front, folded_rows

expand_p = Primitive("moe_xla_ep_expand")


def folded_slots(slots, per_batch: int):
    """[B, N, mult] slots into B blocks of per_batch rows -> [B N, mult] slots into the stack."""
    return folded_rows(slots, per_batch).reshape(slots.shape[0] * slots.shape[1], slots.shape[2])


def _batch(args, dims, *, num_pairs):
    (rows, slots, weights), size = all_to_front(args, dims)
    n, h = slots.shape[1], rows.shape[-1]
    out = expand_p.bind(rows.reshape(size * n, h), folded_slots(slots, num_pairs),
                        weights.reshape(size * n, weights.shape[-1]), num_pairs=size * num_pairs)
    return out.reshape(size, num_pairs, h), 0


expand_p.def_impl(expand_rows)
expand_p.def_abstract_eval(lambda rows, slots, weights, *, num_pairs: jax.core.ShapedArray(
    (num_pairs, rows.shape[1]), rows.dtype))
ad.primitive_jvps[expand_p] = _ad.bilinear_jvp(expand_p, 0, 2)
batching.primitive_batchers[expand_p] = _batch
mlir.register_lowering(expand_p, mlir.lower_fun(expand_rows, multiple_results=False))
