"""quantize_fp8_group_cols: FP8 quantisation of an FP8 wgrad operand in 128 x 1 column
tiles that restart at every group boundary, written transposed (the contract is
common/fp8_blockwise.h, Fp8GroupColsParams).

    x [M, K] float32 / bfloat16 / float16, group_sizes [G] int32
      -> q_t [K, 128 T] float8_e4m3fn, scales [T, K] float32,    T = ceil(M/128) + G
    segments  the G groups' rows (clamped to the M rows as gmm's), then the rows past the
              last group; segment s, rows start_s .. start_s + len_s - 1, is cut into
              ceil(len_s / 128) tiles of 128 rows from start_s, numbered in row order:
              first_tile(s) = sum over s' < s of ceil(len_s' / 128)
    tile t, column k: amax, scale and q as quantize_fp8_rows has them, over the tile's rows
    row start_s + i goes to column 128 first_tile(s) + i of q_t, so
              x[start_s + i, k] ~ q_t[k, 128 first_tile(s) + i] * scales[first_tile(s) + i // 128, k]
    columns of no row are 0, the scales of tiles of no row 1.

The operands of tgmm_fp8, the FP8 wgrad out[g] = x[rows of g]^T dy[rows of g]: x and dy
are both quantised this way, so that each group's rows start at a 128-aligned column and
fill whole tiles (zero past the group). Columns are independent: the op shards along K
(q_t dim 0, scales dim 1). vmap folds the batch into M: each element's groups and then
a spacer group over its remaining rows (its segment past the groups), after which each
element's tiles, contiguous in the folded result, are sliced out. Bitwise the same on the
CPU and CUDA kernels and in reference.quantize_fp8_group_cols. Not differentiable (see _fp8).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import ad, batching

from moe_xla.primitives import _batching, _checks, _fp8, _impl, _lowering, _sharding

quantize_fp8_group_cols_p = Primitive("moe_xla_quantize_fp8_group_cols")
quantize_fp8_group_cols_p.multiple_results = True


def quantize_fp8_group_cols(x, group_sizes, *, pow2_scale=False):
    """(q_t [K, 128 T], scales [T, K]) of x [M, K] in 128-row tiles per group, T =
    ceil(M/128) + G. See the module docstring for the rules."""
    pow2_scale = _checks.static_bool("quantize_fp8_group_cols", "pow2_scale", pow2_scale)
    return quantize_fp8_group_cols_p.bind(x, group_sizes, pow2_scale=pow2_scale)


def _abstract_eval(x, group_sizes, *, pow2_scale):
    _checks.rank("quantize_fp8_group_cols", "x", x, 2, "[M, K]")
    _checks.float_dtype("quantize_fp8_group_cols", "x", x)
    _checks.group_sizes("quantize_fp8_group_cols", group_sizes)
    m, k = x.shape
    t = _fp8.tiles(m) + group_sizes.shape[0]
    return _fp8.outputs((k, _fp8.TILE * t), (t, k))


def _batch(args, dims, *, pow2_scale):
    (x, group_sizes), b = _batching.all_to_front(args, dims)
    _, m, k = x.shape
    folded = _batching.folded_group_sizes(group_sizes, m)  # [B * (G + 1)]: the segments
    q_t, scales = quantize_fp8_group_cols_p.bind(x.reshape(b * m, k), folded, pow2_scale=pow2_scale)
    return list(unfold_tiles(q_t, scales, folded, b, m)), [0, 0]


def unfold_tiles(q_t, scales, folded, b: int, m: int):
    """The batched (q_t [B, K, 128 T], scales [B, T, K]) from those of the folded rows
    [B * M, K] in the segments `folded` [B * (G + 1)] (each element's G groups, then a
    spacer over its remaining rows), T = ceil(M/128) + G."""
    g = folded.shape[0] // b - 1
    t = _fp8.tiles(m) + g
    # Element i's tiles: `used[i]` (at most T) from `first[i]`. Padding past the end keeps
    # every slice of T tiles in bounds; tiles past used[i] become tiles of no row.
    used = jnp.sum((-(-folded // _fp8.TILE)).reshape(b, g + 1), axis=1)
    first = jnp.cumsum(used) - used
    q_t = jnp.pad(q_t, ((0, 0), (0, _fp8.TILE * t)))
    scales = jnp.pad(scales, ((0, t), (0, 0)), constant_values=1.0)
    q_t = jax.vmap(lambda f: jax.lax.dynamic_slice_in_dim(q_t, _fp8.TILE * f, _fp8.TILE * t, axis=1))(first)
    scales = jax.vmap(lambda f: jax.lax.dynamic_slice_in_dim(scales, f, t, axis=0))(first)
    mine = jnp.arange(t)[None, :] < used[:, None]  # [B, T]
    q_t = jnp.where(jnp.repeat(mine, _fp8.TILE, axis=1)[:, None, :], q_t, jnp.zeros((), q_t.dtype))
    return q_t, jnp.where(mine[:, :, None], scales, 1.0)


def _specs(arg_axes, **_):
    k = arg_axes[0][1]
    return ([((), k), ((),)], [(k, ()), ((), k)], ())


# Columns are independent: split along K (q_t dim 0, scales dim 1); rows, groups and tiles
# stay whole.
SHARDING = _sharding.Rule(sharding_rule=lambda **_: "m k, g -> k c, t k", specs=_specs,
                          need_replication=("m", "g", "c", "t"))

_impl.def_jitted_impl(quantize_fp8_group_cols_p)
quantize_fp8_group_cols_p.def_abstract_eval(_abstract_eval)
ad.primitive_jvps[quantize_fp8_group_cols_p] = _fp8.not_differentiable("quantize_fp8_group_cols")
batching.primitive_batchers[quantize_fp8_group_cols_p] = _batch
_lowering.register(quantize_fp8_group_cols_p, "quantize_fp8_group_cols", _fp8.attributes, sharding=SHARDING)
