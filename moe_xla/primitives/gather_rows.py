"""gather_rows: rows gathered through an index, each optionally scaled (contract in
common/gather_rows.h).

    values [T, H] float32 / bfloat16 / float16, src [R] int32, factor [R] float32 or None
      -> rows [R, H] in values' dtype:
         rows[r] = values[src[r]]                 without factor: a bitwise copy
         rows[r] = rnd(factor[r] * values[src[r]])  the product in float32 (float32 subnormal
                   operands and products of magnitude at most 2^-126 count as zeros of their
                   sign: reference.fp8_scaled_element), rounded once to the dtype
         where 0 <= src[r] < T; a zero row where src[r] is outside [0, T) (no other row read)

Bitwise the same on the CPU and CUDA kernels and in reference.gather_rows (NaN products are
NaN, of the platform's sign and payload). Handlers MoeXlaGatherRows{Cpu,Cuda} in
ffi/gather_rows_{cpu,cuda}.cc; kernels cpu/gather_rows.cc and cuda/gather_rows.cu (the row
copy of cuda/row_gather.cuh, which permute's dispatch shares).

gather_rows is linear in values, and bilinear in (values, factor) with a factor:
    d values[t] = sum_{r: src[r] = t} factor[r] ct[r]     (factor 1 without one)
    d factor[r] = <ct[r], values[src[r]]>                  (float32; 0 where src[r] names no row)
Both deterministic (no scatter-add): d values sorts the rows stably by src and sums each
run by a segmented scan (_rows.sum_rows_into), for any src. unique_sources=True promises
that src names each token at most once; d values is then one gather_rows through the
inverse of src, and a token named twice would get only one of its terms.

Output rows are independent: the op shards along R (src, factor and rows split alike) and
along H (values' columns and rows' alike); T stays whole (any row may be named). It vmaps
by folding the batch into R (and into T where values are batched).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import ad, batching

import moe_xla._rows as _rows
from moe_xla.primitives import _ad, _batching, _checks, _impl, _lowering, _sharding

OP = "gather_rows"

gather_rows_p = Primitive("moe_xla_gather_rows")
_bilinear_jvp = _ad.bilinear_jvp(gather_rows_p, 0, 2)  # with a factor: in (values, factor)


def gather_rows(values, src, factor=None, *, unique_sources=False):
    """rows [R, H] of values [T, H] and src [R] int32: rows[r] = factor[r] * values[src[r]]
    (factor [R] float32, or None for a plain copy), 0 where src[r] is outside [0, T). See
    the module docstring; unique_sources=True (a promise that src names each token at most
    once) makes the gradient in values one gather."""
    unique_sources = _checks.static_bool(OP, "unique_sources", unique_sources)
    factors = () if factor is None else (factor,)
    return gather_rows_p.bind(values, src, *factors, has_factor=factor is not None, unique_sources=unique_sources)


def _abstract_eval(values, src, *factor, has_factor, unique_sources):
    _checks.rank(OP, "values", values, 2, "[T, H]")
    _checks.float_dtype(OP, "values", values)
    _checks.rank(OP, "src", src, 1, "[R]")
    _checks.int32(OP, "src", src)
    r = src.shape[0]
    if has_factor:
        (f,) = factor
        if jnp.dtype(f.dtype) != jnp.dtype(jnp.float32):
            raise TypeError(f"{OP}: expected float32 factor, got {f.dtype}")
        if tuple(f.shape) != (r,):
            raise ValueError(f"{OP}: expected factor of shape ({r},) (R of src [R]), got {tuple(f.shape)}")
    return jax.core.ShapedArray((r, values.shape[1]), values.dtype)


def _jvp(primals, tangents, *, has_factor, unique_sources):
    params = dict(has_factor=has_factor, unique_sources=unique_sources)
    if has_factor:
        return _bilinear_jvp(primals, tangents, **params)
    out = gather_rows_p.bind(*primals, **params)
    if type(tangents[0]) is ad.Zero:
        return out, _ad.zero_tangent(out)
    return out, gather_rows_p.bind(tangents[0], primals[1], **params)


def _values_cotangent(ct, src, factor, num_values: int, unique_sources: bool):
    """sum_{r: src[r] = t} factor[r] ct[r] for each of num_values tokens (factor None: 1)."""
    weights = jnp.ones(src.shape, jnp.float32) if factor is None else factor
    if not unique_sources:
        return _rows.sum_rows_into(ct, src[:, None], weights[:, None], num_rows=num_values)
    inverse, inverse_factor = _rows.expansion_sources(src[:, None], weights[:, None], num_pairs=num_values)
    return gather_rows(ct, inverse, None if factor is None else inverse_factor)


def _transpose(ct, values, src, *factor, has_factor, unique_sources):
    if ad.is_undefined_primal(src):
        raise ValueError(f"{OP}: src is integer and cannot be differentiated")
    f = factor[0] if has_factor else None
    if ad.is_undefined_primal(values):
        aval = values.aval
        if type(ct) is ad.Zero:
            return ad.Zero(aval), None, *(None,) * has_factor
        d_values = _values_cotangent(ct, src, f, aval.shape[0], unique_sources)
        return d_values.astype(aval.dtype), None, *(None,) * has_factor
    aval = f.aval
    if type(ct) is ad.Zero:
        return None, None, ad.Zero(aval)
    return None, None, _rows.row_dots(ct, values, src[:, None])[:, 0].astype(aval.dtype)


def _batch(args, dims, *, has_factor, unique_sources):
    values, src, *factor = args
    params = dict(has_factor=has_factor, unique_sources=unique_sources)
    if dims[0] is None:  # one values array for every batch entry: the batch folds into R
        (src, *factor), size = _batching.all_to_front([src, *factor], dims[1:])
        # Entries of the batch may name the same token: no longer unique.
        params["unique_sources"] = False
    else:  # B stacked values arrays: src indexes the stack, invalid entries stay invalid
        (values, src, *factor), size = _batching.all_to_front(args, dims)
        t = values.shape[1]
        values, src = values.reshape(size * t, values.shape[2]), _batching.folded_rows(src, t)
    r = src.shape[1]
    out = gather_rows_p.bind(values, src.reshape(size * r), *(f.reshape(size * r) for f in factor), **params)
    return out.reshape(size, r, out.shape[-1]), 0


def _specs(arg_axes, *, has_factor, **_):
    values, src = arg_axes[:2]
    r = src[0] or (arg_axes[2][0] if has_factor else ())
    h = () if set(values[1]) & set(r) else values[1]
    return ([((), h), (r,)] + [(r,)] * has_factor, [(r, h)], ())


# Output rows are independent and columns too: src, factor and rows split along R, values'
# and rows' columns along H; T stays whole (any row may be named).
SHARDING = _sharding.Rule(sharding_rule=lambda has_factor, **_: "t h, r" + ", r" * has_factor + " -> r h",
                          specs=_specs, need_replication=("t",))

_impl.def_jitted_impl(gather_rows_p)
gather_rows_p.def_abstract_eval(_abstract_eval)
ad.primitive_jvps[gather_rows_p] = _jvp
ad.primitive_transposes[gather_rows_p] = _transpose
batching.primitive_batchers[gather_rows_p] = _batch
_lowering.register(gather_rows_p, OP, lambda **_: {}, sharding=SHARDING)
