// Internal interface between the FP8 dispatcher (fp8_grouped_gemm.cu) and the CUTLASS
// FP8 instantiations (cutlass_fp8_instance.cu, compiled once per entry of the table in
// cuda/BUILD.bazel). Not part of the API.
#ifndef MOE_XLA_CUDA_FP8_GROUPED_GEMM_INTERNAL_H_
#define MOE_XLA_CUDA_FP8_GROUPED_GEMM_INTERNAL_H_

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "common/fp8_grouped_gemm.h"
#include "common/status.h"
#include "cuda/grouped_gemm_internal.h"  // kWorkspaceAlign, align_up, RasterOrder

namespace moe_xla {
namespace cuda {
namespace detail {

// CUTLASS configurations of the FP8 blockwise grouped GEMM (CutlassFp8Tile in
// cutlass_fp8_grouped.cuh): kernel schedule, CTA tile MxNxK and cluster MxN. K is 128,
// one scale block per k step (CUTLASS requires the tile's K to be a multiple of the scale
// granularity).
enum class Fp8TileConfig : int32_t {
  kCoop128x128Cluster1x2 = 0,     // cooperative 128x128x128, cluster 1x2 (A multicast)
  kCoop128x128Cluster2x1 = 1,     // cooperative 128x128x128, cluster 2x1 (B multicast)
  kPingpong64x128Cluster1x1 = 2,  // pingpong    64x128x128,  cluster 1x1
};

// How the two operands of a CUTLASS FP8 GEMM are scaled, over (M or N, K) of CUTLASS's
// D[M, N] = A[M, K] B[K, N]:
//   kRowTilesBlocks  A per row per 128-deep step (scales [M, Kt], K-major), B per 128 x
//                    128 block (N-major): the forward and dgrad (Fp8GroupedGemmParams);
//   kColTiles        A per row and B per column, per 128-deep step, both MN-major
//                    ([Kt, M] and [Kt, N]): the wgrad (Fp8WgradParams), whose K is the
//                    rows of the layer's product.
enum class Fp8Scaling : int32_t { kRowTilesBlocks = 0, kColTiles = 1 };

struct CutlassFp8Args {
  const Fp8GroupedGemmParams* params;
  void* workspace;  // kWorkspaceAlign-aligned
  size_t workspace_bytes;
  int sm_count;
  cudaStream_t stream;
  RasterOrder raster = RasterOrder::kAlongM;
  int team_clusters = INT32_MAX;  // the tile order of team_scheduler.cuh (S, W); INT32_MAX:
  int team_waves = 1;             // CUTLASS's round robin over the whole grid
};

// Defined in cutlass_fp8_grouped.cuh, instantiated by cutlass_fp8_instance.cu for one
// (output dtype, tile) entry of the table. The run enqueues two kernels: prep (per-group
// problem shapes, operand and scale pointers, and the zeroing of rows past the groups),
// then the GEMM.
template <DType kOut, Fp8TileConfig kTile>
size_t cutlass_fp8_workspace_bytes(int64_t num_groups, int sm_count);

template <DType kOut, Fp8TileConfig kTile>
Status cutlass_fp8_run(const CutlassFp8Args& args);

// The wgrad on the CUTLASS kernel of (output dtype, tile) with kColTiles scaling,
// instantiated by cutlass_fp8_wgrad_instance.cu per entry of its table in
// cuda/BUILD.bazel (defined in cutlass_fp8_wgrad.cuh). The run enqueues the prep kernel
// (problem shapes, pointers, and the zeroing of the outputs of groups with no rows), then
// the GEMM.
struct CutlassFp8WgradArgs {
  const Fp8WgradParams* params;
  void* workspace;  // kWorkspaceAlign-aligned
  size_t workspace_bytes;
  int sm_count;
  cudaStream_t stream;
};

template <DType kOut, Fp8TileConfig kTile>
size_t cutlass_fp8_wgrad_workspace_bytes(int64_t num_groups, int sm_count);

template <DType kOut, Fp8TileConfig kTile>
Status cutlass_fp8_wgrad_run(const CutlassFp8WgradArgs& args);

}  // namespace detail
}  // namespace cuda
}  // namespace moe_xla

#endif  // MOE_XLA_CUDA_FP8_GROUPED_GEMM_INTERNAL_H_
