"""tgmm_fp8: the FP8 wgrad, the grouped product contracted over each group's rows, on
operands quantised in group column tiles (the contract is common/fp8_grouped_gemm.h,
Fp8WgradParams).

    lhs_t [K, 128 T] float8_e4m3fn, lhs_scales [T, K] float32   (quantize_fp8_group_cols of x [M, K])
    rhs_t [N, 128 T] float8_e4m3fn, rhs_scales [T, N] float32   (quantize_fp8_group_cols of dy [M, N])
    group_sizes [G] int32, rows = M (static)  ->  out [G, K, N] bfloat16 or float32
    T = ceil(rows / 128) + G

For group g (its rows clamped to the M rows as gmm's), over its tiles t in row order:
    P_t[k, n] = sum over the tile's 128 columns c, in order, of lhs_t[k, c] * rhs_t[n, c]   (float32)
    acc       = fma(fl(P_t[k, n] * lhs_scales[t, k]), rhs_scales[t, n], acc),   acc = 0 first
    out[g, k, n] = acc in preferred_element_type; 0 for a group with no rows
so out[g] ~ x[rows of g]^T @ dy[rows of g]. Both operands must come from the same rows and
group_sizes: the tiles of group g are where quantize_fp8_group_cols put its rows.

`path` picks the CUDA kernel (tests, benchmarks): "auto", "simt" (the contract's order,
bitwise the CPU kernel), "cutlass" or "pingpong" (Hopper's FP8 tensor cores, whose tile
sums round in their own order: CUTLASS's cooperative 128 x 128 tile, or its pingpong
64 x 128 tile), "wgmma128x128" or "wgmma128x192" (our Hopper kernel with 128 x 128 or
128 x 192 tiles; K % 4 == 0, N % 8 == 0); a forced path that cannot compute the product
fails at run time naming it. The CPU has one kernel and ignores it.

A primitive on quantised data, so not differentiable (see _fp8). vmap folds the batch
into the tiles and the groups: element i's T tiles follow element i-1's, and a spacer
group after its G groups covers the rest of them (its rows past the groups and its unused
tiles), whose result is dropped. Under a mesh it splits along K and N (lhs_t and
lhs_scales along K, rhs_t and rhs_scales along N); the rows, their tiles and the groups
stay whole.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import ad, batching

from moe_xla.primitives import _batching, _checks, _fp8, _impl, _lowering, _sharding

tgmm_fp8_p = Primitive("moe_xla_tgmm_fp8")

# The kernels by their attribute value (cuda::Fp8WgradPath in cuda/fp8_wgrad.h).
PATHS = ("auto", "simt", "cutlass", "pingpong", "wgmma128x128", "wgmma128x192")


def tgmm_fp8(lhs_t, lhs_scales, rhs_t, rhs_scales, group_sizes, *, rows, preferred_element_type=jnp.float32,
             path="auto"):
    """out[g] = dequant(lhs_t)[:, tiles of g] @ dequant(rhs_t)[:, tiles of g]^T, tile by
    tile. See the module docstring."""
    out_dtype = _fp8.product_dtype("tgmm_fp8", preferred_element_type)
    _fp8.check_path("tgmm_fp8", PATHS, path)
    if isinstance(rows, (bool, np.bool_)) or not isinstance(rows, (int, np.integer)) or rows < 0:
        raise TypeError(f"tgmm_fp8: expected rows to be a non-negative Python int (M, the rows the operands were "
                        f"quantised from), got {rows!r}")
    return tgmm_fp8_p.bind(lhs_t, lhs_scales, rhs_t, rhs_scales, group_sizes, rows=int(rows),
                           preferred_element_type=out_dtype, path=path)


def _abstract_eval(lhs_t, lhs_scales, rhs_t, rhs_scales, group_sizes, *, rows, preferred_element_type, path):
    _checks.rank("tgmm_fp8", "lhs_t", lhs_t, 2, "[K, 128 T]")
    _checks.rank("tgmm_fp8", "rhs_t", rhs_t, 2, "[N, 128 T]")
    _fp8.check_operand("tgmm_fp8", "lhs_t", lhs_t)
    _fp8.check_operand("tgmm_fp8", "rhs_t", rhs_t)
    _checks.group_sizes("tgmm_fp8", group_sizes)
    g = group_sizes.shape[0]
    t = _fp8.tiles(rows) + g
    for name, operand in (("lhs_t", lhs_t), ("rhs_t", rhs_t)):
        _checks.dim("tgmm_fp8", f"{name}.shape[1] = 128 T (T = ceil(rows / 128) + G with rows {rows}, G {g})",
                    _fp8.TILE * t, operand.shape[1])
    k, n = lhs_t.shape[0], rhs_t.shape[0]
    _fp8.check_scales("tgmm_fp8", "lhs_scales", lhs_scales, (t, k))
    _fp8.check_scales("tgmm_fp8", "rhs_scales", rhs_scales, (t, n))
    return jax.core.ShapedArray((g, k, n), preferred_element_type)


def _batch(args, dims, *, rows, **params):
    (lhs_t, lhs_scales, rhs_t, rhs_scales, group_sizes), b = _batching.all_to_front(args, dims)
    g = group_sizes.shape[1]
    t = _fp8.tiles(rows) + g
    # Element i: its clamped groups, then a spacer group of whole tiles up to its T-th.
    sizes = _batching.clamped_group_sizes(group_sizes, rows)
    spacer = _fp8.TILE * (t - jnp.sum(-(-sizes // _fp8.TILE), axis=1, keepdims=True))
    folded = jnp.concatenate([sizes, spacer], axis=1).reshape(-1).astype(jnp.int32)
    # The folded call has rows 128 B T, so T' = B T + B (G + 1): B (G + 1) tiles of padding
    # (zeros, scale 1) after the B elements' tiles hold the rows past the last spacer.
    pad = b * (g + 1)

    def operand(x):  # [B, X, 128 T] -> [X, 128 T']
        x = jnp.moveaxis(x, 0, 1).reshape(x.shape[1], b * _fp8.TILE * t)
        return jnp.pad(x, ((0, 0), (0, _fp8.TILE * pad)))

    def scales(s):  # [B, T, X] -> [T', X]
        return jnp.pad(s.reshape(b * t, s.shape[2]), ((0, pad), (0, 0)), constant_values=1.0)

    out = tgmm_fp8_p.bind(operand(lhs_t), scales(lhs_scales), operand(rhs_t), scales(rhs_scales), folded,
                          rows=_fp8.TILE * b * t, **params)
    return out.reshape(b, g + 1, *out.shape[1:])[:, :g], 0


def _specs(arg_axes, **_):
    k = arg_axes[0][0] or arg_axes[1][1]
    n = arg_axes[2][0] or arg_axes[3][1]
    if set(k) & set(n):
        n = ()
    return ([(k, ()), ((), k), (n, ()), ((), n), ((),)], [((), k, n)], ())


# K and N split (the weight gradient's two dimensions, each with its operand's scales);
# the tiles along the rows and the groups stay whole.
SHARDING = _sharding.Rule(sharding_rule=lambda **_: "k c, t k, n c, t n, g -> g k n", specs=_specs,
                          need_replication=("c", "t", "g"))

_impl.def_jitted_impl(tgmm_fp8_p)
tgmm_fp8_p.def_abstract_eval(_abstract_eval)
ad.primitive_jvps[tgmm_fp8_p] = _fp8.not_differentiable(
    "tgmm_fp8", "it takes quantised operands; it is the wgrad of an FP8 product, not a differentiable op")
batching.primitive_batchers[tgmm_fp8_p] = _batch
_lowering.register(tgmm_fp8_p, "tgmm_fp8",
                   lambda *, rows, path, **_: {"rows": np.int64(rows), "path": np.int32(PATHS.index(path))},
                   cuda_workspace=_lowering.fp8_wgrad_workspace, sharding=SHARDING)
