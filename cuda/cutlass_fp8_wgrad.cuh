// The FP8 wgrad (common/fp8_grouped_gemm.h, Fp8WgradParams) on CUTLASS 4's sm90 FP8
// blockwise-scaled ptr-array grouped GEMM with one scale per row of A and per column of B
// per 128-deep step (CutlassFp8GroupedGemm with Fp8Scaling::kColTiles).
//
// Only cutlass_fp8_wgrad_instance.cu includes this header, once per entry of the wgrad
// table in cuda/BUILD.bazel. Per group g with rows (tiles first_g .. first_g + n_g - 1 of
// the group-column layout, n_g > 0), CUTLASS's D[M,N] = A[M,K] B[K,N], both K-major:
//   M = K (the layer's), N = N, K = 128 n_g (whole tiles: the columns past the group's
//   rows hold 0, so no TMA bound falls inside a tile and the scale steps are the tiles).
//   A = lhs_t + 128 first_g ([K, 128 n_g] of the row-major [K, 128 T], ld 128 T);
//   B = rhs_t + 128 first_g (stored [N, 128 n_g] of [N, 128 T]: column-major [K, N], ld 128 T);
//   D = out + g K N (row-major [K, N], ld N).
//   SFA = lhs_scales + first_g K: [n_g, K] of [T, K], MN-major (the packed layout CUTLASS
//   rebuilds from the problem shape: step stride K); SFB = rhs_scales + first_g N likewise.
// Groups with no rows get M = 0 (no tile; a K of 0 would leave the accumulators
// unwritten) and the prep kernel zeroes their outputs.
#ifndef MOE_XLA_CUDA_CUTLASS_FP8_WGRAD_CUH_
#define MOE_XLA_CUDA_CUTLASS_FP8_WGRAD_CUH_

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>

#include "cuda/cutlass_fp8_grouped.cuh"
#include "cuda/fp8_grouped_gemm_internal.h"
#include "cuda/group_offsets.cuh"

namespace moe_xla {
namespace cuda {
namespace detail {

template <DType kOut, Fp8TileConfig kTile>
using CutlassFp8Wgrad = CutlassFp8GroupedGemm<kOut, kTile, Fp8Scaling::kColTiles>;

// Grid (x, y) of kScanThreads threads. Block (0, 0) scans the groups' tiles and writes
// every group's problem shape, pointers, strides and scale layouts. Blocks (x, y) zero
// their share of out[g] for g = y, y + gridDim.y, ... when group g has no rows (its
// clamped size, from the sum of the sizes before it, is 0).
template <class Config>
__global__ void __launch_bounds__(kScanThreads)
    cutlass_fp8_wgrad_prep_kernel(Fp8WgradParams p, typename Config::Meta meta) {
  const int64_t width = fp8::kTile * group_col_tiles(p.m, p.num_groups);
  const int ik = static_cast<int>(p.k), in = static_cast<int>(p.n);
  if (blockIdx.x == 0 && blockIdx.y == 0) {
    int64_t group_tiles = 0;
    scan_group_tiles<kScanThreads>(p.group_sizes, p.num_groups, p.m, fp8::kTile, &group_tiles,
                                   [&](int64_t g, int64_t start, int64_t end, int64_t first) {
      const int depth = static_cast<int>(fp8::tiles(end - start) * fp8::kTile);
      meta.shapes[g] = cute::make_shape(depth > 0 ? ik : 0, in, depth);
      meta.ptr_a[g] = reinterpret_cast<const typename Config::ElementAB*>(p.lhs_t + first * fp8::kTile);
      meta.ptr_b[g] = reinterpret_cast<const typename Config::ElementAB*>(p.rhs_t + first * fp8::kTile);
      meta.ptr_d[g] = static_cast<typename Config::ElementD*>(p.out) + g * p.k * p.n;
      meta.ptr_sfa[g] = p.lhs_scales + first * p.k;
      meta.ptr_sfb[g] = p.rhs_scales + first * p.n;
      meta.stride_a[g] = make_leading_stride<typename Config::StrideA>(width);
      meta.stride_b[g] = make_leading_stride<typename Config::StrideB>(width);
      meta.stride_d[g] = make_leading_stride<typename Config::StrideD>(p.n);
      meta.layout_sfa[g] = Config::ScaleConfig::tile_atom_to_shape_SFA(cute::make_shape(ik, in, depth, 1));
      meta.layout_sfb[g] = Config::ScaleConfig::tile_atom_to_shape_SFB(cute::make_shape(ik, in, depth, 1));
    });
  }
  const int64_t vecs = p.k * p.n * static_cast<int64_t>(sizeof(typename Config::ElementD)) / 16;
  for (int64_t g = blockIdx.y; g < p.num_groups; g += gridDim.y) {
    // Rows before group g (clamped to M) and its own: a block-wide sum of the sizes before it.
    int64_t before = 0;
    for (int64_t base = 0; base < g; base += kScanThreads) {
      const int64_t i = base + threadIdx.x;
      const int32_t s = i < g ? p.group_sizes[i] : 0;
      int64_t chunk = 0;
      block_inclusive_scan<kScanThreads>(s > 0 ? s : 0, &chunk);
      before += chunk;
    }
    const int32_t own = p.group_sizes[g];
    const int64_t start = before < p.m ? before : p.m;
    const int64_t end = before + (own > 0 ? own : 0) < p.m ? before + (own > 0 ? own : 0) : p.m;
    if (end > start) continue;
    uint4* out = reinterpret_cast<uint4*>(static_cast<typename Config::ElementD*>(p.out) + g * p.k * p.n);
    for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < vecs;
         i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
      out[i] = uint4{0u, 0u, 0u, 0u};
    }
  }
}

template <DType kOut, Fp8TileConfig kTile>
size_t cutlass_fp8_wgrad_workspace_bytes(int64_t num_groups, int sm_count) {
  return fp8_config_workspace_bytes<CutlassFp8Wgrad<kOut, kTile>>(num_groups, sm_count);
}

template <DType kOut, Fp8TileConfig kTile>
Status cutlass_fp8_wgrad_run(const CutlassFp8WgradArgs& a) {
  using Config = CutlassFp8Wgrad<kOut, kTile>;
  const Fp8WgradParams& p = *a.params;
  constexpr const char* kWhat = "CUTLASS FP8 wgrad";
  MOE_XLA_RETURN_IF_ERROR(check_fp8_metadata<Config>(p.num_groups, a.workspace_bytes, kWhat));
  char* base = static_cast<char*>(a.workspace);
  const typename Config::Meta meta(base, typename Config::MetaLayout(p.num_groups));

  // The zeroing of empty groups' outputs: a few blocks per group, at most 65535 groups a pass.
  const dim3 grid(4, static_cast<unsigned>(std::min<int64_t>(p.num_groups, 65535)));
  cutlass_fp8_wgrad_prep_kernel<Config><<<grid, kScanThreads, 0, a.stream>>>(p, meta);
  MOE_XLA_RETURN_IF_CUDA_ERROR(cudaGetLastError());

  auto args = make_fp8_arguments<Config>(p.num_groups, a.sm_count, RasterOrder::kAlongM, INT32_MAX, 1, meta);
  return run_fp8_gemm<Config>(args, base, a.workspace_bytes, p.num_groups, a.stream, kWhat);
}

}  // namespace detail
}  // namespace cuda
}  // namespace moe_xla

#endif  // MOE_XLA_CUDA_CUTLASS_FP8_WGRAD_CUH_
