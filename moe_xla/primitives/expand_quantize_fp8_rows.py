"""expand_quantize_fp8_rows: token rows expanded into the rows of their (token, expert)
pairs, each scaled, fused with the FP8 row quantisation of the unscaled rows. In the MoE
backward sorted row slots[t, j] of the expert outputs' cotangent is weight[t, j] * ct[t]
(the transpose of the weighted combine): the rows, which feed the bf16 weight gradient; the
FP8 dgrad takes ct[t] unweighted (q, scales), the routing weight entering later, in the
activation's backward (contract in common/fp8_blockwise.h, Fp8ExpandQuantizeParams).

    values [T, H] float32 / bfloat16 / float16, slots [T, k] int32, factor [T, k] float32
    or None (every factor 1), num_rows R
      -> rows [R, H] in values' dtype:
         rows[r] = rnd(factor[t, j] * values[t])  for the pair (t, j) that owns row r: the
         last in row-major order with slots[t, j] = r; 0 where none names r (entries
         outside [0, R) name no row)
         the product in float32, rounded once to the dtype (float32 subnormal operands
         count as zeros, products of magnitude at most 2^-126 as zeros of their sign:
         reference.fp8_scaled_element)
      -> q [R, H] float8_e4m3fn, scales [R, ceil(H/128)] float32 = quantize_fp8_rows(u),
         bitwise, of the unscaled rows: u[r] = rnd(1 * values[t]) for the owner (t, j) of
         row r (entries of magnitude at most 2^-126 as zeros of their sign, as in the
         product above), 0 where none names r; the factor does not enter them (with
         factors 1 they are the quantisation of the rows returned)

factor=None: every factor 1 with no [T, k] array of ones to fill (the call takes values and
slots alone): rows = u, the same bits as factors of ones (1 * v is exact, and both take
the one product rnd(1 * v) with the same flushing), so, like them, not a plain copy of the
token rows: entries of magnitude at most 2^-126 (float32 / bfloat16 subnormals and
+-2^-126 included) are zeros of their sign.

With permute's row map as slots (each row named once) rows[slots[t, j]] = factor[t, j] *
values[t] and (q, scales)[slots[t, j]] = quantize_fp8_rows(values)[t] where no entry is
+-2^-126. Each token row is read and quantised once however many rows it fills, where a
gather of the rows through their tokens reads it k times. Whatever slots hold, every row
has one writer, and no access leaves the arrays. Bitwise the same on the CPU and CUDA kernels and in
reference.expand_quantize_fp8_rows (NaN rows are NaN, of the platform's sign and payload).
Handlers MoeXlaExpandQuantizeFp8Rows{Cpu,Cuda}V2 in ffi/quantize_fp8_{cpu,cuda}.cc (the factor
an optional last operand; the CUDA one keeps the row owners in a workspace result); kernels
cpu/fp8_quantize.cc (fp8_expand_quantize) and cuda/fp8_expand_rows.cu (a null factor is
every factor 1).

Not differentiable (see _fp8). vmaps by folding the batch into T and R (slots of entry b
name rows of entry b only), with or without a factor. No sharding rule: any token may fill
any row, so a sharded call runs on the gathered operands.
"""

from __future__ import annotations

import jax
from jax.extend.core import Primitive
from jax.interpreters import ad, batching

import moe_xla._lib as _lib
from moe_xla.primitives import _batching, _checks, _fp8, _impl, _lowering

OP = "expand_quantize_fp8_rows"
INT32_LIMIT = 2 ** 31

expand_quantize_fp8_rows_p = Primitive("moe_xla_expand_quantize_fp8_rows")
expand_quantize_fp8_rows_p.multiple_results = True


def expand_quantize_fp8_rows(values, slots, factor, num_rows: int, *, pow2_scale=False):
    """(rows, q, scales) of values [T, H], slots [T, k] int32 and factor [T, k] float32, or
    None for every factor 1: rows[slots[t, j]] = factor[t, j] * values[t] in values' dtype
    ([num_rows, H]; rows no slot names are 0) and the 1 x 128 row quantisation of the rows
    with factor 1. See the module docstring."""
    pow2_scale = _checks.static_bool(OP, "pow2_scale", pow2_scale)
    if not isinstance(num_rows, int) or isinstance(num_rows, bool) or not 0 <= num_rows < INT32_LIMIT:
        raise ValueError(f"{OP}: expected num_rows to be an int in [0, 2^31), got {num_rows!r}")
    factors = () if factor is None else (factor,)  # none: the call has no factor operand
    return tuple(expand_quantize_fp8_rows_p.bind(values, slots, *factors, num_rows=num_rows, pow2_scale=pow2_scale,
                                                 has_factor=factor is not None))


def _abstract_eval(values, slots, *factor, num_rows, pow2_scale, has_factor):
    _checks.rank(OP, "values", values, 2, "[T, H]")
    _checks.float_dtype(OP, "values", values)
    _checks.rank(OP, "slots", slots, 2, "[T, k]")
    _checks.int32(OP, "slots", slots)
    _checks.dim(OP, "slots.shape[0] (T of values [T, H])", values.shape[0], slots.shape[0])
    if slots.shape[0] * slots.shape[1] >= INT32_LIMIT:
        raise ValueError(f"{OP}: expected fewer than 2^31 pairs (T * k), got {slots.shape[0] * slots.shape[1]}")
    if len(factor) != has_factor:
        raise ValueError(f"{OP}: expected {'one factor operand' if has_factor else 'no factor operand'} "
                         f"(has_factor={has_factor}), got {len(factor)}")
    for f in factor:
        _fp8.check_scales(OP, "factor", f, slots.shape)
    h = values.shape[1]
    q, scales = _fp8.outputs((num_rows, h), (num_rows, _fp8.tiles(h)))
    return [jax.core.ShapedArray((num_rows, h), values.dtype), q, scales]


def _batch(args, dims, *, num_rows, pow2_scale, has_factor):
    (values, slots, *factor), size = _batching.all_to_front(args, dims)
    t, k = slots.shape[1:]
    out = expand_quantize_fp8_rows_p.bind(values.reshape(size * t, values.shape[2]),
                                          _batching.folded_rows(slots, num_rows).reshape(size * t, k),
                                          *(f.reshape(size * t, k) for f in factor), num_rows=size * num_rows,
                                          pow2_scale=pow2_scale, has_factor=has_factor)
    return [o.reshape(size, num_rows, o.shape[-1]) for o in out], [0, 0, 0]


def _attributes(pow2_scale, **_):
    return _fp8.attributes(pow2_scale=pow2_scale)


def _cuda_workspace(values, slots, *_, num_rows, **__):
    return _lib.cuda_workspace_bytes("MoeXlaExpandQuantizeFp8RowsWorkspaceBytes", num_rows,
                                     slots.shape[0] * slots.shape[1])


_impl.def_jitted_impl(expand_quantize_fp8_rows_p)
expand_quantize_fp8_rows_p.def_abstract_eval(_abstract_eval)
ad.primitive_jvps[expand_quantize_fp8_rows_p] = _fp8.not_differentiable(OP)
batching.primitive_batchers[expand_quantize_fp8_rows_p] = _batch
_lowering.register(expand_quantize_fp8_rows_p, OP, _attributes, cuda_workspace=_cuda_workspace)
