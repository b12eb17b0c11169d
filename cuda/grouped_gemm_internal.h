// Internal interface between the dispatcher (grouped_gemm.cu), the SIMT fallback
// (fallback_gemm.cu) and the CUTLASS instantiations (cutlass_instance.cu, compiled once
// per entry of the instance table in cuda/BUILD.bazel). Not part of the API.
#ifndef MOE_XLA_CUDA_GROUPED_GEMM_INTERNAL_H_
#define MOE_XLA_CUDA_GROUPED_GEMM_INTERNAL_H_

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "common/grouped_gemm.h"
#include "common/status.h"

namespace moe_xla {
namespace cuda {
namespace detail {

// Every region carved out of the workspace starts on this boundary (TMA descriptors need
// 64 bytes, the rest less).
constexpr size_t kWorkspaceAlign = 256;

inline size_t align_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

// CUTLASS kernel configurations (see CutlassTile in cutlass_grouped.cuh). Names give the
// kernel schedule, the CTA tile MxNxK and the cluster shape MxN.
enum class TileConfig : int32_t {
  kSmall = 0,                     // pingpong    64x128x128, cluster 1x1
  kLarge = 1,                     // cooperative 128x256x64, cluster 2x1
  kCoop128x256Cluster1x1 = 2,     // cooperative 128x256x64, cluster 1x1
  kCoop128x256Cluster1x2 = 3,     // cooperative 128x256x64, cluster 1x2
  kPingpong64x256Cluster2x1 = 4,  // pingpong    64x256x64,  cluster 2x1
};

// Order in which the persistent group tile scheduler walks the output tiles of a group
// (CUTLASS RasterOrderOptions; a runtime argument, no recompile):
//   kAlongM: consecutive tiles go down M (the CTAs running together share B tiles),
//   kAlongN: consecutive tiles go along N (they share A tiles).
enum class RasterOrder : int32_t { kAlongM = 0, kAlongN = 1 };

struct CutlassGroupedArgs {
  const GroupedGemmParams* params;
  // offsets[g] = first row of group g, offsets[G] = rows covered by groups: G + 1 int64 of
  // device memory that the run's prep kernel writes from params->group_sizes.
  int64_t* offsets;
  void* workspace;  // kWorkspaceAlign-aligned
  size_t workspace_bytes;
  int sm_count;
  cudaStream_t stream;
  RasterOrder raster = RasterOrder::kAlongM;
  // Team order of the tile scheduler (team_scheduler.cuh): clusters per team and waves per
  // block; >= the grid's clusters or <= 1 wave: CUTLASS's order.
  int team_clusters = 1;
  int team_waves = 1;
};

// Defined in cutlass_grouped.cuh; each compilation of cutlass_instance.cu explicitly
// instantiates both for exactly one (dtype, layout, tile) combination of the instance table
// in cuda/BUILD.bazel, from which the build also generates the dispatcher's list. The run
// enqueues two kernels: prep (offsets, per-group metadata, and for gmm the zeroing of rows
// past the groups), then the GEMM.
template <DType kDType, GroupedLayout kLayout, TileConfig kTile>
size_t cutlass_grouped_workspace_bytes(int64_t num_groups, int sm_count);

template <DType kDType, GroupedLayout kLayout, TileConfig kTile>
Status cutlass_grouped_run(const CutlassGroupedArgs& args);

// SIMT fallback (fallback_gemm.cu): writes every element of the output, including rows
// past the last group (gmm) and blocks of empty groups (tgmm).
Status fallback_grouped_run(const GroupedGemmParams& p, const int64_t* offsets,
                            cudaStream_t stream);

}  // namespace detail
}  // namespace cuda
}  // namespace moe_xla

#endif  // MOE_XLA_CUDA_GROUPED_GEMM_INTERNAL_H_
