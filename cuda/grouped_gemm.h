// CUDA grouped GEMM (gmm, gmm with transposed rhs, tgmm) for the contract in
// common/grouped_gemm.h. Framework-free: no XLA, no Python.
//
// Everything is enqueued on the given stream: group sizes stay on the device (no copy to
// the host, no synchronisation, no process-global mutable state), so the launch can be
// captured into a CUDA graph.
//
// Paths:
//   - CUTLASS sm90 ptr-array grouped GEMM (TMA + wgmma, warp-specialised persistent
//     kernels) for bf16 -> bf16 (several tile configurations) and f16 -> f16 (one), when K
//     and N are multiples of 8 and the pointers are 16-byte aligned (TMA requirements).
//   - Our Hopper kernel for bf16 gmm with K <= 256 (rhs [G, K, N]): each expert's K x 256
//     weight block stays in shared memory while a tile of the group's rows streams past
//     (resident_b_gemm_kernel.cuh).
//   - A shared-memory tiled SIMT fallback with f32 accumulation for everything else
//     (f32, mixed output dtype, unaligned shapes).
// All start from a device-side scan of the clamped group sizes.
#ifndef MOE_XLA_CUDA_GROUPED_GEMM_H_
#define MOE_XLA_CUDA_GROUPED_GEMM_H_

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "common/grouped_gemm.h"
#include "common/status.h"

namespace moe_xla {
namespace cuda {

// Which kernel family computes the product. kAuto lets a shape heuristic choose; the
// others force a path (tests, benchmarks) and fail with an error message when the
// product is not eligible for it (see grouped_gemm_path_supported).
// CUTLASS paths are named by kernel schedule, CTA tile MxNxK and cluster MxN; the
// layouts each one is instantiated for are listed in kCutlassInstances (grouped_gemm.cu).
enum class GroupedGemmPath : int32_t {
  kAuto = 0,
  kFallback = 1,      // SIMT, every dtype/layout/shape
  kCutlassSmall = 2,  // bf16 only: pingpong 64x128x128 tiles, cluster 1x1
  kCutlassLarge = 3,  // bf16, f16: cooperative 128x256x64 tiles, cluster 2x1
  kCutlassCoop128x256Cluster1x1 = 4,     // bf16 gmm, gmm_t
  kCutlassCoop128x256Cluster1x2 = 5,     // bf16 gmm, gmm_t, tgmm
  kCutlassPingpong64x256Cluster2x1 = 6,  // bf16 gmm, gmm_t, tgmm
  kResidentB64x256 = 7,                  // bf16 gmm with K <= 256 (ours; 64-row sub-tiles, 256 columns)
};

// Every concrete path (not kAuto), for tests and benchmarks that sweep them.
inline constexpr GroupedGemmPath kGroupedGemmPaths[] = {
    GroupedGemmPath::kFallback,
    GroupedGemmPath::kCutlassSmall,
    GroupedGemmPath::kCutlassLarge,
    GroupedGemmPath::kCutlassCoop128x256Cluster1x1,
    GroupedGemmPath::kCutlassCoop128x256Cluster1x2,
    GroupedGemmPath::kCutlassPingpong64x256Cluster2x1,
    GroupedGemmPath::kResidentB64x256,
};

// Order in which the CUTLASS persistent tile scheduler hands out the output tiles of a
// group (a runtime argument of the same kernel). kAlongM: consecutive tiles go down M, so
// the CTAs running at the same time share B tiles (one expert's weight columns) and each A
// row block is re-read once per N tile; kAlongN: consecutive tiles go along N, so they
// share A tiles and each row block is read once while it is hot in L2.
enum class GroupedGemmRaster : int32_t { kAuto = 0, kAlongM = 1, kAlongN = 2 };

inline constexpr int32_t kTeamAuto = 0;
inline constexpr int32_t kTeamWholeGrid = INT32_MAX;

// Everything that picks the kernel of one product. Fields left at kAuto are resolved by
// grouped_gemm_select_config. Framework-free; the FFI handlers pass the default (all auto),
// tests and benchmarks force fields.
struct GroupedGemmConfig {
  GroupedGemmPath path = GroupedGemmPath::kAuto;
  GroupedGemmRaster raster = GroupedGemmRaster::kAuto;  // CUTLASS paths only
  // Tile order across the persistent grid (CUTLASS paths only; cuda/team_scheduler.cuh):
  // in blocks of `team_waves` waves, teams of `team_clusters` clusters each walk one
  // contiguous stretch of the output tiles, so a cluster stays in one group for several
  // tiles. A field left at kTeamAuto is chosen by shape; kTeamWholeGrid clusters (or any
  // count >= the grid's clusters) or 1 wave: CUTLASS's round-robin order.
  int32_t team_clusters = kTeamAuto;
  int32_t team_waves = kTeamAuto;
};

// Short name of a path ("auto", "fallback", "cutlass_small", "cutlass_large",
// "cutlass_coop128x256_1x1", ...).
const char* grouped_gemm_path_name(GroupedGemmPath path);

// Short name of a raster order ("auto", "along_m", "along_n").
const char* grouped_gemm_raster_name(GroupedGemmRaster raster);

// Short name of a config's team order: "auto" (a field left at kTeamAuto), "grid"
// (CUTLASS's round-robin order: kTeamWholeGrid clusters or 1 wave), else "SxW" (S clusters
// per team, W waves per block).
std::string grouped_gemm_team_name(const GroupedGemmConfig& config);

// Whether `path` can compute this product (kAuto and kFallback always can).
bool grouped_gemm_path_supported(const GroupedGemmParams& p, GroupedGemmPath path);

// The concrete path kAuto resolves to for these params on a GPU with `sm_count` SMs.
GroupedGemmPath grouped_gemm_select_path(const GroupedGemmParams& p, int sm_count);

// `config` with its auto fields resolved for these params (path first, then the raster
// order and team size for that path). Fields set by the caller are kept as they are.
GroupedGemmConfig grouped_gemm_select_config(const GroupedGemmParams& p, int sm_count,
                                             GroupedGemmConfig config = {});

// Bytes of device scratch `grouped_gemm` needs for these params (group offsets, then
// CUTLASS per-group metadata and workspace or the resident-B kernel's row-tile table, plus
// alignment slack). Any alignment of the scratch pointer is accepted.
size_t grouped_gemm_workspace_bytes(const GroupedGemmParams& p, int sm_count,
                                    GroupedGemmPath path = GroupedGemmPath::kAuto);

// An upper bound of grouped_gemm_workspace_bytes over every dtype, layout, K, N and path
// for `m` rows of lhs and `num_groups` groups on GPUs with at most `max_sm_count` SMs: for
// callers that must size the scratch before the device is known (e.g. a workspace buffer
// XLA allocates as an extra custom-call result, whose address stays valid across
// CUDA-graph replays).
size_t grouped_gemm_workspace_bytes_bound(int64_t m, int64_t num_groups, int max_sm_count);

// Enqueues the grouped product on `stream`, with every tuning field (path, raster order,
// team size) of `config` under the caller's control (all auto by default). `sm_count` is
// cudaDevAttrMultiProcessorCount of the current device; the workspace holds at least
// grouped_gemm_workspace_bytes(p, sm_count, config.path) bytes. On a GPU other than
// compute capability 9.0 the auto path is the SIMT fallback and any other forced path is
// an error (cuda/device_support.h).
Status grouped_gemm(const GroupedGemmParams& p, void* workspace, size_t workspace_bytes,
                    int sm_count, cudaStream_t stream, const GroupedGemmConfig& config = {});

}  // namespace cuda
}  // namespace moe_xla

#endif  // MOE_XLA_CUDA_GROUPED_GEMM_H_
