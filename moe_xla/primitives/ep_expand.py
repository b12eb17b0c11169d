"""ep_expand: the EP layer's expansion of received rows to their (row, local expert) pairs.

    out[slots[q, j]] = weights[q, j] * rows[q]        out [num_pairs, H]; pairs no slot names: 0

rows [N, H]; slots [N, mult] int32, naming each of the num_pairs output rows at most once
(an index outside [0, num_pairs) names none); weights [N, mult] float32. The product is
taken in float32 (or the inputs' wider dtype) and rounded once to rows' dtype.

Lowered, on every platform, as a gather through the inverse of slots: (src, factor) =
_rows.expansion_sources (an XLA scatter of distinct int32 places), then the gather_rows
kernel, out[r] = rnd(factor[r] * rows[src[r]]), zero rows where no slot names r; so its
products of magnitude at most 2^-126 are signed zeros (gather_rows' rule), also with
weight 1. float64 rows, which gather_rows does not take, go through jnp
(_rows.expand_rows). A gather, no scatter-add: deterministic.

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

import jax.numpy as jnp

from moe_xla._rows import expand_rows, expansion_sources
from moe_xla.primitives import _ad
from moe_xla.primitives._batching import all_to_front, folded_rows
from moe_xla.primitives.gather_rows import gather_rows_p

# The dtypes the gather_rows kernels take.
KERNEL_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)

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


def _expand(rows, slots, weights, *, num_pairs):
    """The lowering (module docstring): gather_rows through the inverse of slots."""
    if rows.dtype not in KERNEL_DTYPES:
        return expand_rows(rows, slots, weights, num_pairs=num_pairs)
    src, factor = expansion_sources(slots, weights, num_pairs=num_pairs)
    return gather_rows_p.bind(rows, src, factor.astype(jnp.float32), has_factor=True, unique_sources=False)


expand_p.def_impl(_expand)
expand_p.def_abstract_eval(lambda rows, slots, weights, *, num_pairs: jax.core.ShapedArray(
    (num_pairs, rows.shape[1]), rows.dtype))
ad.primitive_jvps[expand_p] = _ad.bilinear_jvp(expand_p, 0, 2)
batching.primitive_batchers[expand_p] = _batch
mlir.register_lowering(expand_p, mlir.lower_fun(_expand, multiple_results=False))
