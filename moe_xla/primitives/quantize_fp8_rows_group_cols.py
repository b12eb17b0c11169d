"""quantize_fp8_rows_group_cols: both FP8 tilings a product's operand needs when its
backward takes the FP8 wgrad, from one read of it (the contract is common/fp8_blockwise.h,
Fp8GroupColsParams with q given).

    x [M, K] float32 / bfloat16 / float16, group_sizes [G] int32
      -> q [M, K] float8_e4m3fn, row_scales [M, ceil(K/128)] float32,
         q_t [K, 128 T] float8_e4m3fn, scales [T, K] float32,        T = ceil(M/128) + G
    (q, row_scales) = quantize_fp8_rows(x)                  1 x 128 row tiles along K
    (q_t, scales)   = quantize_fp8_group_cols(x, group_sizes)   128 x 1 column tiles along M,
                                                             restarting at every group, transposed
bitwise, on the CPU and CUDA kernels and in reference.quantize_fp8_rows_group_cols.

gmm(quantization="fp8_blockwise_fp8_wgrad") quantises its lhs with it in the forward
(the rows for the product, the column tiles kept for the wgrad instead of lhs) and dy in
the backward (the rows for the dgrad, the column tiles for the wgrad): x and dy are each
read once. It runs on the whole of x on one device: a sharded x is gathered first (the
column tiles need every row; SHARDING says why K stays whole). vmap folds the batch into M as quantize_fp8_group_cols
does. Not differentiable (see _fp8).
"""

from __future__ import annotations

from jax.extend.core import Primitive
from jax.interpreters import ad, batching

from moe_xla.primitives import _batching, _checks, _fp8, _impl, _lowering, _sharding
from moe_xla.primitives.quantize_fp8_group_cols import unfold_tiles

quantize_fp8_rows_group_cols_p = Primitive("moe_xla_quantize_fp8_rows_group_cols")
quantize_fp8_rows_group_cols_p.multiple_results = True


def quantize_fp8_rows_group_cols(x, group_sizes, *, pow2_scale=False):
    """(q [M, K], row_scales [M, ceil(K/128)], q_t [K, 128 T], scales [T, K]) of x [M, K]:
    quantize_fp8_rows(x) and quantize_fp8_group_cols(x, group_sizes) from one pass over x,
    T = ceil(M/128) + G. See the module docstring."""
    pow2_scale = _checks.static_bool("quantize_fp8_rows_group_cols", "pow2_scale", pow2_scale)
    return quantize_fp8_rows_group_cols_p.bind(x, group_sizes, pow2_scale=pow2_scale)


def _abstract_eval(x, group_sizes, *, pow2_scale):
    op = "quantize_fp8_rows_group_cols"
    _checks.rank(op, "x", x, 2, "[M, K]")
    _checks.float_dtype(op, "x", x)
    _checks.group_sizes(op, group_sizes)
    m, k = x.shape
    t = _fp8.tiles(m) + group_sizes.shape[0]
    return _fp8.outputs((m, k), (m, _fp8.tiles(k))) + _fp8.outputs((k, _fp8.TILE * t), (t, k))


def _batch(args, dims, *, pow2_scale):
    (x, group_sizes), b = _batching.all_to_front(args, dims)
    _, m, k = x.shape
    folded = _batching.folded_group_sizes(group_sizes, m)  # [B * (G + 1)]: the segments
    q, row_scales, q_t, scales = quantize_fp8_rows_group_cols_p.bind(x.reshape(b * m, k), folded,
                                                                     pow2_scale=pow2_scale)
    return [q.reshape(b, m, k), row_scales.reshape(b, m, _fp8.tiles(k)), *unfold_tiles(q_t, scales, folded, b, m)], [0] * 4


def _specs(arg_axes, **_):
    return ([((), ()), ((),)], [((), ()), ((), ()), ((), ()), ((), ())], ())


# Nothing splits: the column tiles need every row, and row_scales' K tiles are a factor of
# their own that Shardy would not shard with K (a K split in whole tiles would leave them
# to be gathered after the call). A sharded x is gathered first, as quantize_fp8_rows
# gathers a K split.
SHARDING = _sharding.Rule(sharding_rule=lambda **_: "m k, g -> m k, m u, k c, t k", specs=_specs,
                          need_replication=("m", "k", "g", "u", "c", "t"))

_impl.def_jitted_impl(quantize_fp8_rows_group_cols_p)
quantize_fp8_rows_group_cols_p.def_abstract_eval(_abstract_eval)
ad.primitive_jvps[quantize_fp8_rows_group_cols_p] = _fp8.not_differentiable("quantize_fp8_rows_group_cols")
batching.primitive_batchers[quantize_fp8_rows_group_cols_p] = _batch
_lowering.register(quantize_fp8_rows_group_cols_p, "quantize_fp8_rows_group_cols", _fp8.attributes,
                   sharding=SHARDING)
