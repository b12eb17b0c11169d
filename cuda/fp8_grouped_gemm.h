// CUDA FP8 blockwise grouped product for the contract in common/fp8_grouped_gemm.h.
// Framework-free: no XLA, no Python.
//
// Everything is enqueued on the given stream: group sizes stay on the device (no copy to
// the host, no synchronisation, no process-global mutable state), so the launch can be
// captured into a CUDA graph.
//
// Paths:
//   - CUTLASS sm90 blockwise-scaled ptr-array grouped GEMM (TMA + FP8 wgmma, warp-
//     specialised persistent kernels) on compute capability 9.0, when K is a multiple of
//     16, N a multiple of 8 (bf16 out) or 4 (f32 out) and the operand, scale and output
//     pointers are 16-byte aligned (TMA's requirements).
//   - Our Hopper kernel (cuda/fp8_wgmma_kernel.cuh: TMA + FP8 wgmma, 128 x 128 or
//     128 x 192 tiles, the promotion of each 128-deep block overlapped with a wgmma of the
//     same or the other consumer warp group; 128 x 192 bf16 tiles also with a bulk-copy
//     store), under the same conditions.
//   - A SIMT kernel for everything else (other shapes, other GPUs): the contract's order
//     exactly, so its results are bitwise those of the CPU kernel.
#ifndef MOE_XLA_CUDA_FP8_GROUPED_GEMM_H_
#define MOE_XLA_CUDA_FP8_GROUPED_GEMM_H_

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "common/fp8_grouped_gemm.h"
#include "common/status.h"

namespace moe_xla {
namespace cuda {

// Which kernel computes the product. kAuto lets a shape heuristic choose; the others force
// a path (tests, benchmarks) and fail with an error message when the product is not
// eligible for it. CUTLASS paths are named by kernel schedule, CTA tile MxN (K 128) and
// cluster MxN; ours by its CTA tile. The values are those of gmm_fp8's `path` attribute (primitives/gmm_fp8.py
// lists the names in this order).
enum class Fp8GemmPath : int32_t {
  kAuto = 0,
  kSimt = 1,
  kCutlassCoop128x128Cluster1x2 = 2,
  kCutlassCoop128x128Cluster2x1 = 3,
  kCutlassPingpong64x128Cluster1x1 = 4,
  kWgmma128x128 = 5,
  kWgmma128x192 = 6,
  kWgmma128x192Bulk = 7,
};

inline constexpr Fp8GemmPath kFp8GemmPaths[] = {
    Fp8GemmPath::kSimt,
    Fp8GemmPath::kCutlassCoop128x128Cluster1x2,
    Fp8GemmPath::kCutlassCoop128x128Cluster2x1,
    Fp8GemmPath::kCutlassPingpong64x128Cluster1x1,
    Fp8GemmPath::kWgmma128x128,
    Fp8GemmPath::kWgmma128x192,
    Fp8GemmPath::kWgmma128x192Bulk,
};

// gmm_fp8's `path` attribute is kAuto (0) or a path of kFp8GemmPaths, numbered 1 .. N in
// its order (the FFI handler checks the range, primitives/gmm_fp8.py lists the names).
constexpr bool fp8_gemm_paths_numbered_in_order() {
  for (size_t i = 0; i < sizeof(kFp8GemmPaths) / sizeof(kFp8GemmPaths[0]); ++i) {
    if (static_cast<int32_t>(kFp8GemmPaths[i]) != static_cast<int32_t>(i) + 1) return false;
  }
  return true;
}
static_assert(fp8_gemm_paths_numbered_in_order(), "Fp8GemmPath values must be 1 .. N in kFp8GemmPaths order");

// Short name of a path ("auto", "simt", "cutlass_coop128x128_1x2", ..., "wgmma128x192").
const char* fp8_gemm_path_name(Fp8GemmPath path);

// Whether `path` can compute this product on a GPU of compute capability 9.0 (kAuto and
// kSimt always can).
bool fp8_gemm_path_supported(const Fp8GroupedGemmParams& p, Fp8GemmPath path);

// The concrete path kAuto resolves to on a compute capability 9.0 GPU with `sm_count` SMs.
Fp8GemmPath fp8_gemm_select_path(const Fp8GroupedGemmParams& p, int sm_count);

// An upper bound of the device scratch fp8_grouped_gemm needs for `m` rows in `num_groups`
// groups, any K, N, dtype and path, on GPUs with at most `max_sm_count` SMs (for a
// workspace buffer sized before the device is known, e.g. an extra custom-call result).
size_t fp8_grouped_gemm_workspace_bytes_bound(int64_t m, int64_t num_groups, int max_sm_count);

// Enqueues the product on `stream`. `sm_count` is cudaDevAttrMultiProcessorCount of the
// current device; the workspace holds at least fp8_grouped_gemm_workspace_bytes_bound(
// p.m, p.num_groups, sm_count) bytes (any alignment). On a GPU other than compute capability
// 9.0 the auto path is the SIMT one and a forced CUTLASS path is an error.
Status fp8_grouped_gemm(const Fp8GroupedGemmParams& p, void* workspace, size_t workspace_bytes, int sm_count,
                        cudaStream_t stream, Fp8GemmPath path = Fp8GemmPath::kAuto);

}  // namespace cuda
}  // namespace moe_xla

#endif  // MOE_XLA_CUDA_FP8_GROUPED_GEMM_H_
