"""gather_quantize_fp8_group_cols: the FP8 wgrad's operands of permuted rows, gathered
straight from the token rows, without the permuted copy in memory (the contract is
common/fp8_blockwise.h, Fp8GroupColsParams with sources given).

    values [T, K] float32 / bfloat16 / float16, sources [M] int32, factor [M] float32 or
    None, group_sizes [G] int32
      w[r] = values[sources[r]]                 where 0 <= sources[r] < T, else a row of +0
      u[r] = rnd(1 * w[r])                      the rows with factor 1
      v[r] = rnd(factor[r] * w[r])              the scaled rows, +0 where w[r] is no row;
                                                v = u without factor
         each product in float32 (float32 subnormal operands and products of magnitude at
         most 2^-126 count as zeros of their sign: reference.fp8_scaled_element), rnd one
         rounding to values' dtype
      -> q [M, K] float8_e4m3fn, row_scales [M, ceil(K/128)] float32 = quantize_fp8_rows(u)
         q_t [K, 128 T'] float8_e4m3fn, scales [T', K] float32
                         = quantize_fp8_group_cols(v, group_sizes),      T' = ceil(M/128) + G
bitwise, on the CPU and CUDA kernels and in reference.gather_quantize_fp8_group_cols
(= reference.gather_rows of u and v, then those two quantisations).

With sources naming each row once (the inverse of permute's row map), (q, row_scales) are
those of expand_quantize_fp8_rows and (q_t, scales) quantize_fp8_group_cols of its rows:
the MoE backward's dgrad operand (the cotangent unweighted) and wgrad operand (weighted)
from one read of the token rows, where the expansion writes the weighted rows out first.
Handlers MoeXlaGatherQuantizeFp8GroupCols{Cpu,Cuda} in ffi/quantize_fp8_cpu.cc and
ffi/quantize_fp8_group_cols_cuda.cc (the factor an optional last operand); kernels
cpu/fp8_quantize.cc and cuda/fp8_group_cols.cu (fp8_quantize_group_cols, with sources).

Not differentiable (see _fp8). vmap folds the batch into M (group sizes with a spacer group
per element, the tiles unfolded after, as quantize_fp8_group_cols) and, for batched values,
into T (sources of element b name its own token rows; invalid ones stay invalid). It runs on
whole operands on one device: any row may name any token, and the column tiles need every
row (a sharded operand is gathered first).
"""

from __future__ import annotations

from jax.extend.core import Primitive
from jax.interpreters import ad, batching

from moe_xla.primitives import _batching, _checks, _fp8, _impl, _lowering, _sharding
from moe_xla.primitives.quantize_fp8_group_cols import unfold_tiles

OP = "gather_quantize_fp8_group_cols"
INT32_LIMIT = 2 ** 31

gather_quantize_fp8_group_cols_p = Primitive("moe_xla_gather_quantize_fp8_group_cols")
gather_quantize_fp8_group_cols_p.multiple_results = True


def gather_quantize_fp8_group_cols(values, sources, factor, group_sizes, *, pow2_scale=False):
    """(q [M, K], row_scales [M, ceil(K/128)], q_t [K, 128 T'], scales [T', K]) of the rows
    values[sources[r]] (zero rows where sources[r] is outside [0, T)): the row tiles of the
    rows, the group column tiles of the rows scaled by factor [M] float32 (None: unscaled),
    T' = ceil(M/128) + G. See the module docstring."""
    pow2_scale = _checks.static_bool(OP, "pow2_scale", pow2_scale)
    factors = () if factor is None else (factor,)  # none: the call has no factor operand
    return tuple(gather_quantize_fp8_group_cols_p.bind(values, sources, group_sizes, *factors, pow2_scale=pow2_scale,
                                                       has_factor=factor is not None))


def _abstract_eval(values, sources, group_sizes, *factor, pow2_scale, has_factor):
    _checks.rank(OP, "values", values, 2, "[T, K]")
    _checks.float_dtype(OP, "values", values)
    _checks.rank(OP, "sources", sources, 1, "[M]")
    _checks.int32(OP, "sources", sources)
    _checks.group_sizes(OP, group_sizes)
    (t, k), m = values.shape, sources.shape[0]
    for name, rows in (("values", t), ("sources", m)):
        if rows >= INT32_LIMIT:
            raise ValueError(f"{OP}: expected {name} of fewer than 2^31 rows, got {rows}")
    if len(factor) != has_factor:
        raise ValueError(f"{OP}: expected {'one factor operand' if has_factor else 'no factor operand'} "
                         f"(has_factor={has_factor}), got {len(factor)}")
    for f in factor:
        _fp8.check_scales(OP, "factor", f, (m,))
    tiles = _fp8.tiles(m) + group_sizes.shape[0]
    return _fp8.outputs((m, k), (m, _fp8.tiles(k))) + _fp8.outputs((k, _fp8.TILE * tiles), (tiles, k))


def _batch(args, dims, *, pow2_scale, has_factor):
    values, *rest = args
    if dims[0] is None:  # one values array for every element: sources index it as they are
        (sources, group_sizes, *factor), b = _batching.all_to_front(rest, dims[1:])
    else:  # B stacked values arrays: sources index the stack, invalid ones stay invalid
        (values, sources, group_sizes, *factor), b = _batching.all_to_front(args, dims)
        t = values.shape[1]
        values, sources = values.reshape(b * t, values.shape[2]), _batching.folded_rows(sources, t)
    m, k = sources.shape[1], values.shape[1]
    folded = _batching.folded_group_sizes(group_sizes, m)  # [B * (G + 1)]: the segments
    q, row_scales, q_t, scales = gather_quantize_fp8_group_cols_p.bind(
        values, sources.reshape(b * m), folded, *(f.reshape(b * m) for f in factor), pow2_scale=pow2_scale,
        has_factor=has_factor)
    rows = [q.reshape(b, m, k), row_scales.reshape(b, m, _fp8.tiles(k))]
    return rows + list(unfold_tiles(q_t, scales, folded, b, m)), [0] * 4


def _specs(arg_axes, **_):
    return [tuple(() for _ in a) for a in arg_axes], [((), ())] * 4, ()


# Nothing splits: any row may name any token, and the column tiles need every row; row_scales'
# K tiles are a factor of their own, as in quantize_fp8_rows_group_cols.
SHARDING = _sharding.Rule(
    sharding_rule=lambda has_factor, **_: "t k, m, g" + ", m" * has_factor + " -> m k, m u, k c, n k",
    specs=_specs, need_replication=("t", "k", "m", "g", "u", "c", "n"))


def _attributes(pow2_scale, **_):
    return _fp8.attributes(pow2_scale=pow2_scale)


_impl.def_jitted_impl(gather_quantize_fp8_group_cols_p)
gather_quantize_fp8_group_cols_p.def_abstract_eval(_abstract_eval)
ad.primitive_jvps[gather_quantize_fp8_group_cols_p] = _fp8.not_differentiable(OP)
batching.primitive_batchers[gather_quantize_fp8_group_cols_p] = _batch
_lowering.register(gather_quantize_fp8_group_cols_p, OP, _attributes, sharding=SHARDING)
