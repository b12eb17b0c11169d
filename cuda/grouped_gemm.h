// CUDA grouped GEMM (gmm, gmm with transposed rhs, tgmm) for the contract in
// common/grouped_gemm.h. Framework-free: no XLA, no Python.
//
// Everything is enqueued on the given stream: group sizes stay on the device (no copy to
// the host, no synchronisation, no process-global mutable state), so the launch can be
// captured into a CUDA graph.
//
// Paths:
//   - CUTLASS sm90 ptr-array grouped GEMM (TMA + wgmma, warp-specialised persistent
//     kernels) for bf16 -> bf16 (two tile configurations) and f16 -> f16 (one), when K and
//     N are multiples of 8 and the pointers are 16-byte aligned (TMA requirements).
//   - A shared-memory tiled SIMT fallback with f32 accumulation for everything else
//     (f32, mixed output dtype, unaligned shapes).
// Both start from a device-side inclusive scan of the clamped group sizes.
#ifndef MOE_XLA_CUDA_GROUPED_GEMM_H_
#define MOE_XLA_CUDA_GROUPED_GEMM_H_

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "common/grouped_gemm.h"

namespace moe_xla {
namespace cuda {

// Which kernel family computes the product. kAuto lets a shape heuristic choose; the
// others force a path (tests, benchmarks) and fail with an error message when the
// product is not eligible for it (see grouped_gemm_path_supported).
enum class GroupedGemmPath : int32_t {
  kAuto = 0,
  kFallback = 1,      // SIMT, every dtype/layout/shape
  kCutlassSmall = 2,  // bf16 only: pingpong 64x128x128 tiles, cluster 1x1
  kCutlassLarge = 3,  // bf16, f16: cooperative 128x256x64 tiles, cluster 2x1
};

// Short name of a path ("auto", "fallback", "cutlass_small", "cutlass_large").
const char* grouped_gemm_path_name(GroupedGemmPath path);

// Whether `path` can compute this product (kAuto and kFallback always can).
bool grouped_gemm_path_supported(const GroupedGemmParams& p, GroupedGemmPath path);

// The concrete path kAuto resolves to for these params on a GPU with `sm_count` SMs.
GroupedGemmPath grouped_gemm_select_path(const GroupedGemmParams& p, int sm_count);

// Bytes of device scratch `grouped_gemm` needs for these params (group offsets, CUTLASS
// per-group metadata and CUTLASS workspace, plus alignment slack). Any alignment of the
// scratch pointer is accepted.
size_t grouped_gemm_workspace_bytes(const GroupedGemmParams& p, int sm_count,
                                    GroupedGemmPath path = GroupedGemmPath::kAuto);

// An upper bound of grouped_gemm_workspace_bytes over every dtype, layout, shape and path
// for `num_groups` groups on GPUs with at most `max_sm_count` SMs: for callers that must
// size the scratch before the device is known (e.g. a workspace buffer XLA allocates as an
// extra custom-call result, whose address stays valid across CUDA-graph replays).
size_t grouped_gemm_workspace_bytes_bound(int64_t num_groups, int max_sm_count);

// Enqueues the grouped product on `stream`. Returns nullptr on success or a static error
// message. `sm_count` is cudaDevAttrMultiProcessorCount of the current device.
const char* grouped_gemm(const GroupedGemmParams& p, void* workspace, size_t workspace_bytes,
                         int sm_count, cudaStream_t stream,
                         GroupedGemmPath path = GroupedGemmPath::kAuto);

}  // namespace cuda
}  // namespace moe_xla

#endif  // MOE_XLA_CUDA_GROUPED_GEMM_H_
