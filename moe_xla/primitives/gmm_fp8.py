"""gmm_fp8: the FP8 blockwise grouped product on quantised operands (the contract is
common/fp8_grouped_gemm.h).

    lhs [M, K] float8_e4m3fn, lhs_scales [M, ceil(K/128)] float32      (1 x 128 row tiles)
    rhs [G, N, K] float8_e4m3fn, rhs_scales [G, ceil(K/128), ceil(N/128)] float32
                                           (128 x 128 blocks of each expert's rhs[g]^T)
    group_sizes [G] int32  ->  out [M, N] bfloat16 or float32 (preferred_element_type)

For a row r of group g (groups clamped to the M rows as gmm's; rows past them are 0):
    out[r, n] = sum_j fl(lhs_scales[r, j] * rhs_scales[g, j, n // 128]) * P_j[r, n],
    P_j[r, n] = sum over k in the 128-deep block j of lhs[r, k] * rhs[g, n, k]
accumulated in float32 block by block. K is contiguous in both operands: the forward of
an FP8 layer passes the weights' quantised blocks transposed ([G, N, K]); its dgrad
passes them as stored ([G, K, N] read as [G, N' = K, K' = N]) with the scales swapped.

`path` picks the CUDA kernel (benchmarks, tests): "auto" (a shape heuristic) or one of
PATHS: CUTLASS's named by kernel schedule, CTA tile M x N (K 128) and cluster M x N, ours
("wgmma128x128", "wgmma128x192") by its CTA tile, "wgmma128x192_bulk" the second with its
bf16 tiles written by bulk copies (no float32 output); a forced path
that cannot compute the product (shape, alignment, GPU) fails at run time naming it. The
CPU has one kernel and ignores it.

A primitive on quantised data, so not differentiable: moe_xla.fp8 wraps it in the
differentiable gmm(quantization="fp8_blockwise"). vmap folds the batch into M and G
(one all-zero spacer expert per element); under a mesh it splits along N when every
shard holds whole 128-column blocks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import ad, batching

from moe_xla.primitives import _batching, _checks, _fp8, _impl, _lowering, _sharding

gmm_fp8_p = Primitive("moe_xla_gmm_fp8")

# The kernels by their attribute value (cuda::Fp8GemmPath in cuda/fp8_grouped_gemm.h).
PATHS = ("auto", "simt", "cutlass_coop128x128_1x2", "cutlass_coop128x128_2x1", "cutlass_pingpong64x128_1x1",
         "wgmma128x128", "wgmma128x192", "wgmma128x192_bulk")


def gmm_fp8(lhs, lhs_scales, rhs, rhs_scales, group_sizes, *, preferred_element_type=jnp.bfloat16, path="auto"):
    """out[rows of g] = dequant(lhs)[rows of g] @ dequant(rhs[g])^T blockwise. See the module docstring."""
    out_dtype = _fp8.product_dtype("gmm_fp8", preferred_element_type)
    _fp8.check_path("gmm_fp8", PATHS, path)
    return gmm_fp8_p.bind(lhs, lhs_scales, rhs, rhs_scales, group_sizes, preferred_element_type=out_dtype, path=path)


def _abstract_eval(lhs, lhs_scales, rhs, rhs_scales, group_sizes, *, preferred_element_type, path):
    _checks.rank("gmm_fp8", "lhs", lhs, 2, "[M, K]")
    _checks.rank("gmm_fp8", "rhs", rhs, 3, "[G, N, K]")
    _fp8.check_operand("gmm_fp8", "lhs", lhs)
    _fp8.check_operand("gmm_fp8", "rhs", rhs)
    m, k = lhs.shape
    g, n, rhs_k = rhs.shape
    _checks.dim("gmm_fp8", "rhs.shape[2] (K of lhs [M, K])", k, rhs_k)
    _fp8.check_scales("gmm_fp8", "lhs_scales", lhs_scales, (m, _fp8.tiles(k)))
    _fp8.check_scales("gmm_fp8", "rhs_scales", rhs_scales, (g, _fp8.tiles(k), _fp8.tiles(n)))
    _checks.group_sizes("gmm_fp8", group_sizes, g)
    return jax.core.ShapedArray((m, n), preferred_element_type)


def _batch(args, dims, *, preferred_element_type, path):
    (lhs, lhs_scales, rhs, rhs_scales, group_sizes), _ = _batching.all_to_front(args, dims)
    b, m, k = lhs.shape
    g = rhs.shape[1]
    # One all-zero spacer expert per batch element covers its rows past its groups, whose
    # results are then set to exactly 0 (a NaN code times 0 is NaN).
    rhs = jnp.concatenate([rhs, jnp.zeros((b, 1) + rhs.shape[2:], rhs.dtype)], axis=1)
    rhs_scales = jnp.concatenate([rhs_scales, jnp.ones((b, 1) + rhs_scales.shape[2:], jnp.float32)], axis=1)
    folded = _batching.folded_group_sizes(group_sizes, m)
    out = gmm_fp8_p.bind(lhs.reshape(b * m, k), lhs_scales.reshape(b * m, -1),
                         rhs.reshape((b * (g + 1),) + rhs.shape[2:]),
                         rhs_scales.reshape((b * (g + 1),) + rhs_scales.shape[2:]), folded,
                         preferred_element_type=preferred_element_type, path=path)
    out = out.reshape(b, m, out.shape[-1])
    covered = m - folded.reshape(b, g + 1)[:, g:]
    return jnp.where((jnp.arange(m) < covered)[..., None], out, jnp.zeros((), out.dtype)), 0


def _specs(arg_axes, **_):
    n = arg_axes[2][1]
    return ([((), ()), ((), ()), ((), n, ()), ((), (), n), ((),)], [((), n)], ())


# Column-parallel experts: N split (rhs dim 1 and its scale blocks, rhs_scales dim 2) when
# each shard holds whole 128-column blocks; rows, groups and K stay whole.
SHARDING = _sharding.Rule(sharding_rule=lambda **_: "m k, m t, g n k, g t u, g -> m n", specs=_specs,
                          need_replication=("m", "k", "t", "g"), whole_tiles=((2, 1),))

_impl.def_jitted_impl(gmm_fp8_p)
gmm_fp8_p.def_abstract_eval(_abstract_eval)
ad.primitive_jvps[gmm_fp8_p] = _fp8.not_differentiable(
    "gmm_fp8", "it takes quantised operands; differentiate moe_xla.gmm(..., quantization=\"fp8_blockwise\")")
batching.primitive_batchers[gmm_fp8_p] = _batch
_lowering.register(gmm_fp8_p, "gmm_fp8", lambda *, path, **_: {"path": np.int32(PATHS.index(path))},
                   cuda_workspace=_lowering.fp8_gemm_workspace,
                   sharding=SHARDING)
