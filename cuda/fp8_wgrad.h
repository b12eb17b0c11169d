// CUDA FP8 wgrad (tgmm_fp8) for the contract of Fp8WgradParams in
// common/fp8_grouped_gemm.h: per group, out[g] = lhs_t[:, group g's tiles] @
// rhs_t[:, group g's tiles]^T with one scale per row of each operand per 128-column tile.
// Framework-free: no XLA, no Python.
//
// Everything is enqueued on the given stream: group sizes stay on the device (no copy to
// the host, no synchronisation), so the launch can be captured into a CUDA graph.
//
// Paths: our Hopper kernel (fp8_wgrad_wgmma_kernel.cuh; two tile widths) and CUTLASS's
// sm90 blockwise-scaled ptr-array grouped GEMM (scale granularity 1 x 1 x 128: per row of
// A, per column of B, per 128-deep step; two tile shapes) on compute capability 9.0 when
// N is a multiple of 8 (bf16 out) or 4 (f32 out) and the pointers are 16-byte aligned; a
// SIMT kernel in the contract's order (bitwise the CPU kernel's) everywhere else.
#ifndef MOE_XLA_CUDA_FP8_WGRAD_H_
#define MOE_XLA_CUDA_FP8_WGRAD_H_

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "common/fp8_grouped_gemm.h"
#include "common/status.h"

namespace moe_xla {
namespace cuda {

// Which kernel computes the wgrad: the values of tgmm_fp8's `path` attribute
// (primitives/tgmm_fp8.py lists the names in this order). kCutlass is the cooperative
// 128 x 128 tile with a 1 x 2 cluster, kPingpong the pingpong 64 x 128 tile (one consumer
// warp group's epilogue under the other's mainloop), kWgmma128x128 / kWgmma128x192 our
// kernel (fp8_wgrad_wgmma_kernel.cuh) with 128 x 128 / 128 x 192 tiles (K % 4 == 0 and
// N % 8 == 0). A forced path that cannot compute the product fails with an error naming it.
enum class Fp8WgradPath : int32_t {
  kAuto = 0,
  kSimt = 1,
  kCutlass = 2,
  kPingpong = 3,
  kWgmma128x128 = 4,
  kWgmma128x192 = 5,
};
inline constexpr int32_t kFp8WgradPathCount = 6;

// The path kAuto takes on a GPU with Hopper's FP8 tensor cores (host only: it reads the
// shapes, dtype and pointers): our kernel where it can compute the product, with 128 x 192
// tiles unless their cluster pairs compute more than 8% of their columns past N (then
// 128 x 128; the ranking: benchmarks/results/LOG.md, sessions 43 and 45), else CUTLASS's
// cooperative tile, else SIMT.
Fp8WgradPath fp8_wgrad_select_path(const Fp8WgradParams& p);

// An upper bound of the device scratch fp8_wgrad needs for `num_groups` groups, any shape
// and dtype, on GPUs with at most `max_sm_count` SMs.
size_t fp8_wgrad_workspace_bytes_bound(int64_t num_groups, int max_sm_count);

// Enqueues the wgrad on `stream`. `sm_count` is cudaDevAttrMultiProcessorCount of the
// current device; the workspace holds at least fp8_wgrad_workspace_bytes_bound(
// p.num_groups, sm_count) bytes (any alignment).
Status fp8_wgrad(const Fp8WgradParams& p, void* workspace, size_t workspace_bytes, int sm_count,
                 cudaStream_t stream, Fp8WgradPath path = Fp8WgradPath::kAuto);

}  // namespace cuda
}  // namespace moe_xla

#endif  // MOE_XLA_CUDA_FP8_WGRAD_H_
