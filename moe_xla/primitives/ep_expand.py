"""ep_expand: the EP layer's expansion of rows to the places its slots name, a bitwise copy.

    out[slots[q, j]] = rows[q]        out [num_pairs, H]; places no slot names: +0

rows [N, H] float32 / bfloat16 / float16; slots [N, mult] int32, naming each of the
num_pairs output rows at most once (an index outside [0, num_pairs) names none). The
layer's dispatch packs token rows into send slabs and received rows into their (row, local
expert) pairs with it.

Lowered, on every platform, as a gather through the inverse of slots: src[r] = q where
slots[q, j] = r, then the gather_rows kernel, out[r] = rows[src[r]], zero rows where no
slot names r. A gather, no scatter-add: deterministic. The inverse is an XLA scatter of
distinct int32 places (_rows.expansion_sources), unless the caller passes it as `sources`
(a caller that knows it from how the slots were built: the transports' send buffers),
which saves the scatter's launches; the transpose reads the slots alone.

Linear in rows; its transpose sums each row's places back in j order, the unpermute kernel
with the slots as row map and weights 1:
    d rows[q] = sum_j ct[slots[q, j]] = unpermute(ct, slots.reshape(-1), 1, unique_rows=True)
whose own transpose is this expansion again (unpermute's gather through the slots' inverse).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

import moe_xla._rows as _rows
from moe_xla.primitives import _ad, _checks
from moe_xla.primitives._batching import all_to_front, folded_rows
from moe_xla.primitives.gather_rows import gather_rows_p
from moe_xla.primitives.unpermute import unpermute

OP = "ep_expand"

expand_p = Primitive("moe_xla_ep_expand")


def expand(rows, slots, *, num_pairs: int, sources=None):
    """[num_pairs, H]: row slots[q, j] is rows[q], bitwise; rows no slot names are +0. See
    the module docstring. sources: None, or the inverse of slots [num_pairs] int32, q where
    slots[q, j] = r and -1 (any index outside [0, N)) where no slot names r; a promise the
    caller keeps (the forward reads sources, the transpose slots)."""
    extra = () if sources is None else (sources,)
    return expand_p.bind(rows, slots, *extra, num_pairs=num_pairs)


def _abstract_eval(rows, slots, *sources, num_pairs):
    _checks.rank(OP, "rows", rows, 2, "[N, H]")
    _checks.float_dtype(OP, "rows", rows)
    _checks.rank(OP, "slots", slots, 2, "[N, mult]")
    _checks.int32(OP, "slots", slots)
    _checks.dim(OP, "slots.shape[0] (rows.shape[0])", rows.shape[0], slots.shape[0])
    for src in sources:
        _checks.rank(OP, "sources", src, 1, "[num_pairs]")
        _checks.int32(OP, "sources", src)
        _checks.dim(OP, "sources.shape[0] (num_pairs)", num_pairs, src.shape[0])
    return jax.core.ShapedArray((num_pairs, rows.shape[1]), rows.dtype)


def _expand(rows, slots, *sources, num_pairs):
    """The lowering (module docstring): gather_rows through the inverse of slots."""
    src = sources[0] if sources else _rows.expansion_sources(slots, num_pairs=num_pairs)[0]
    return gather_rows_p.bind(rows, src, has_factor=False, unique_sources=False)


def _jvp(primals, tangents, *, num_pairs):
    out = expand_p.bind(*primals, num_pairs=num_pairs)
    if type(tangents[0]) is ad.Zero:
        return out, _ad.zero_tangent(out)
    return out, expand_p.bind(tangents[0], *primals[1:], num_pairs=num_pairs)


def _transpose(ct, rows, slots, *sources, num_pairs):
    nones = (None,) * (1 + len(sources))
    if type(ct) is ad.Zero:
        return (ad.Zero(rows.aval), *nones)
    return (unpermute(ct, slots.reshape(-1), top_k=slots.shape[1], unique_rows=True).astype(rows.aval.dtype), *nones)


def _batch(args, dims, *, num_pairs):
    (rows, slots, *sources), size = all_to_front(args, dims)
    n, mult = slots.shape[1], slots.shape[2]
    folded = folded_rows(slots, num_pairs).reshape(size * n, mult)
    # Batch b's sources name rows of its own block of n: b * n + q, or past every block.
    folded_sources = [folded_rows(src, n).reshape(size * num_pairs) for src in sources]
    out = expand_p.bind(rows.reshape(size * n, rows.shape[-1]), folded, *folded_sources, num_pairs=size * num_pairs)
    return out.reshape(size, num_pairs, rows.shape[-1]), 0


expand_p.def_impl(_expand)
expand_p.def_abstract_eval(_abstract_eval)
ad.primitive_jvps[expand_p] = _jvp
ad.primitive_transposes[expand_p] = _transpose
batching.primitive_batchers[expand_p] = _batch
mlir.register_lowering(expand_p, mlir.lower_fun(_expand, multiple_results=False))
