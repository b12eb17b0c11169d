"""ep_expand: the EP layer's expansion of received rows to their (row, local expert) pairs.

    out[slots[q, j]] = weights[q, j] * rows[q]        out [num_pairs, H]; pairs no slot names: 0
    out[slots[q, j]] = rows[q]                        without weights: a bitwise copy

rows [N, H]; slots [N, mult] int32, naming each of the num_pairs output rows at most once
(an index outside [0, num_pairs) names none); weights [N, mult] float32 or none. The
product is taken in float32 (or the inputs' wider dtype) and rounded once to rows' dtype.

Lowered, on every platform, as a gather through the inverse of slots: (src, factor) =
_rows.expansion_sources (an XLA scatter of distinct int32 places), then the gather_rows
kernel, out[r] = rnd(factor[r] * rows[src[r]]) (products of magnitude at most 2^-126 are
signed zeros: gather_rows' rule) or out[r] = rows[src[r]], zero rows where no slot names
r. float64 rows, which gather_rows does not take, go through jnp (_rows.expand_rows). A
gather, no scatter-add: deterministic.

With weights, bilinear in (rows, weights), and the transpose of ep_gather_sum:
    d rows = ep_gather_sum(ct, slots, weights)      (weights 1 without them)
    d weights[q, j] = <rows[q], ct[slots[q, j]]>
That transpose is registered in ep_gather_sum.py: ep_gather_sum's transpose is an
ep_expand, so one of the two files holds both directions and imports the other.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from moe_xla._rows import expand_rows, expansion_sources
from moe_xla.primitives import _ad
from moe_xla.primitives._batching import all_to_front, folded_rows
from moe_xla.primitives.gather_rows import gather_rows_p

# The dtypes the gather_rows kernels take.
KERNEL_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)

expand_p = Primitive("moe_xla_ep_expand")


def expand(rows, slots, weights=None, *, num_pairs: int):
    """[num_pairs, H]: row slots[q, j] is weights[q, j] * rows[q] (rows[q] itself, bitwise,
    without weights); rows no slot names are 0. See the module docstring."""
    return expand_p.bind(rows, slots, *(() if weights is None else (weights,)), num_pairs=num_pairs,
                         weighted=weights is not None)


def folded_slots(slots, per_batch: int):
    """[B, N, mult] slots into B blocks of per_batch rows -> [B N, mult] slots into the stack."""
    return folded_rows(slots, per_batch).reshape(slots.shape[0] * slots.shape[1], slots.shape[2])


def _batch(args, dims, *, num_pairs, weighted):
    (rows, slots, *weights), size = all_to_front(args, dims)
    n, h = slots.shape[1], rows.shape[-1]
    weights = [w.reshape(size * n, w.shape[-1]) for w in weights]
    out = expand_p.bind(rows.reshape(size * n, h), folded_slots(slots, num_pairs), *weights,
                        num_pairs=size * num_pairs, weighted=weighted)
    return out.reshape(size, num_pairs, h), 0


def _expand(rows, slots, *weights, num_pairs, weighted):
    """The lowering (module docstring): gather_rows through the inverse of slots."""
    w = weights[0] if weighted else jnp.ones(slots.shape, jnp.float32)
    if rows.dtype not in KERNEL_DTYPES:
        return expand_rows(rows, slots, w, num_pairs=num_pairs)
    src, factor = expansion_sources(slots, w, num_pairs=num_pairs)
    factors = (factor.astype(jnp.float32),) if weighted else ()
    return gather_rows_p.bind(rows, src, *factors, has_factor=weighted, unique_sources=False)


_bilinear_jvp = _ad.bilinear_jvp(expand_p, 0, 2)


def _jvp(primals, tangents, *, num_pairs, weighted):
    if weighted:
        return _bilinear_jvp(primals, tangents, num_pairs=num_pairs, weighted=True)
    out = expand_p.bind(*primals, num_pairs=num_pairs, weighted=False)
    if type(tangents[0]) is ad.Zero:
        return out, _ad.zero_tangent(out)
    return out, expand_p.bind(tangents[0], primals[1], num_pairs=num_pairs, weighted=False)


expand_p.def_impl(_expand)
expand_p.def_abstract_eval(lambda rows, slots, *weights, num_pairs, weighted: jax.core.ShapedArray(
    (num_pairs, rows.shape[1]), rows.dtype))
ad.primitive_jvps[expand_p] = _jvp
batching.primitive_batchers[expand_p] = _batch
mlir.register_lowering(expand_p, mlir.lower_fun(_expand, multiple_results=False))
