"""gather_quantize_fp8_rows: rows gathered through an index and scaled, fused with their FP8
row quantisation: the operand of the FP8 dgrad in the MoE backward, where row r of the
sorted expert outputs' cotangent is weight_r * ct[token_r] (the transpose of the weighted
combine; contract in common/fp8_blockwise.h, Fp8GatherQuantizeParams).

    values [T, H] float32 / bfloat16 / float16, src [R] int32, scale [R] float32
      -> rows [R, H] in values' dtype:
         rows[r] = rnd(scale[r] * values[src[r]])  where 0 <= src[r] < T, else 0
         the product in float32, rounded once to the dtype (float32 subnormal operands
         count as zeros, products of magnitude at most 2^-126 as zeros of their sign:
         reference.fp8_scaled_element)
      -> q [R, H] float8_e4m3fn, scales [R, ceil(H/128)] float32 = quantize_fp8_rows(rows),
         bitwise, of the rows returned

One pass over the gathered rows where the unfused path writes rows, then reads them again
to quantise them. No index reads outside values, whatever src holds: an entry outside
[0, T) (negative, T or more) gives a zero row, q 0 and scales 1. Bitwise the same on the
CPU and CUDA kernels and in reference.gather_quantize_fp8_rows (NaN rows are NaN, of the
platform's sign and payload). Handlers MoeXlaGatherQuantizeFp8Rows{Cpu,Cuda} in
ffi/quantize_fp8_{cpu,cuda}.cc; kernels cpu/fp8_quantize.cc (fp8_gather_quantize) and
cuda/fp8_quantize.cu (the Gathered source of the row quantisation kernel).

Not differentiable (see _fp8). Output rows are independent: the op shards along R (src,
scale and the outputs split alike, values whole) and vmaps by folding the batch into R
(and into T where values are batched).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import ad, batching

from moe_xla.primitives import _batching, _checks, _fp8, _impl, _lowering, _sharding

OP = "gather_quantize_fp8_rows"

gather_quantize_fp8_rows_p = Primitive("moe_xla_gather_quantize_fp8_rows")
gather_quantize_fp8_rows_p.multiple_results = True


def gather_quantize_fp8_rows(values, src, scale, *, pow2_scale=False):
    """(rows, q, scales) of values [T, H], src [R] int32 and scale [R] float32: rows[r] =
    scale[r] * values[src[r]] in values' dtype (0 where src[r] is outside [0, T)) and its
    1 x 128 row quantisation. See the module docstring."""
    pow2_scale = _checks.static_bool(OP, "pow2_scale", pow2_scale)
    return tuple(gather_quantize_fp8_rows_p.bind(values, src, scale, pow2_scale=pow2_scale))


def _abstract_eval(values, src, scale, *, pow2_scale):
    _checks.rank(OP, "values", values, 2, "[T, H]")
    _checks.float_dtype(OP, "values", values)
    _checks.rank(OP, "src", src, 1, "[R]")
    if jnp.dtype(src.dtype) != jnp.dtype(jnp.int32):
        raise TypeError(f"{OP}: expected int32 src, got {src.dtype}")
    r, h = src.shape[0], values.shape[1]
    _fp8.check_scales(OP, "scale", scale, (r,))
    q, scales = _fp8.outputs((r, h), (r, _fp8.tiles(h)))
    return [jax.core.ShapedArray((r, h), values.dtype), q, scales]


def _batch(args, dims, *, pow2_scale):
    values, src, scale = args
    if dims[0] is None:  # one values array for every batch entry: the batch folds into R
        (src, scale), size = _batching.all_to_front([src, scale], dims[1:])
    else:  # B stacked values arrays: src indexes the stack, invalid entries stay invalid
        (values, src, scale), size = _batching.all_to_front(args, dims)
        t = values.shape[1]
        values, src = values.reshape(size * t, values.shape[2]), _batching.folded_rows(src, t)
    r = src.shape[1]
    out = gather_quantize_fp8_rows_p.bind(values, src.reshape(size * r), scale.reshape(size * r),
                                          pow2_scale=pow2_scale)
    return [o.reshape(size, r, o.shape[-1]) for o in out], [0, 0, 0]


def _specs(arg_axes, **_):
    r = arg_axes[1][0] or arg_axes[2][0]
    return ([((), ()), (r,), (r,)], [(r, ())] * 3, ())


# Output rows are independent: src, scale and the outputs split along R; values (any row
# may be named) and the columns (H and its tiles) stay whole.
SHARDING = _sharding.Rule(sharding_rule=lambda **_: "t h, r, r -> r h, r h, r s", specs=_specs,
                          need_replication=("t", "h", "s"))

_impl.def_jitted_impl(gather_quantize_fp8_rows_p)
gather_quantize_fp8_rows_p.def_abstract_eval(_abstract_eval)
ad.primitive_jvps[gather_quantize_fp8_rows_p] = _fp8.not_differentiable(OP)
batching.primitive_batchers[gather_quantize_fp8_rows_p] = _batch
_lowering.register(gather_quantize_fp8_rows_p, OP, _fp8.attributes, sharding=SHARDING)
