// CUDA gather grouped GEMM for the contract in common/gather_gemm.h: the first expert GEMM
// of a MoE layer, reading its rows x[src[r]] straight from the tokens instead of from a
// gathered copy. Framework-free: no XLA, no Python.
//
// Hopper only (compute capability 9.0): a warp-specialised persistent kernel whose
// producer warps gather A rows with cp.async and load B tiles with TMA, and whose consumer
// warp groups multiply them with wgmma (cuda/gather_gemm_kernel.cuh). bf16 x and w,
// float32 accumulation, bf16 or f32 output; w [G, K, N], or [G, N, K] with transpose_w
// (the same kernel with a K-major B operand).
//
// Requirements, each an InvalidArgument error when not met: K and N multiples of 8 (rows
// of x and w of whole 16-byte chunks, as cp.async and TMA read them); x, w and out 16-byte
// aligned; T, M, K, N and G at most 2^31 - 256.
//
// Everything is enqueued on the given stream: group sizes stay on the device (two prep
// kernels turn them into a table of row tiles in the workspace, and zero the rows past the
// groups), no host synchronisation, no process-global mutable state, so the launch can be
// captured into a CUDA graph. Whatever group_sizes and src hold, nothing is read or written
// out of bounds.
#ifndef MOE_XLA_CUDA_GATHER_GEMM_H_
#define MOE_XLA_CUDA_GATHER_GEMM_H_

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "common/gather_gemm.h"
#include "common/status.h"

namespace moe_xla {
namespace cuda {

// Bytes of device scratch `gather_gemm` needs for these params (the per-group tile counts
// and the row-tile table, plus alignment slack); 0 for params it rejects. Any alignment of
// the scratch pointer is accepted.
size_t gather_gemm_workspace_bytes(const GatherGemmParams& p);

// The same for any params of M output rows and G groups it accepts: the scratch depends on
// M and G only (so a caller can size it before knowing the rest); 0 when M or G is out of
// range.
size_t gather_gemm_workspace_bytes(int64_t m, int64_t num_groups);

// Enqueues out = gather grouped product (common/gather_gemm.h) on `stream`, on the current
// device. The workspace holds at least gather_gemm_workspace_bytes(p) bytes.
Status gather_gemm(const GatherGemmParams& p, void* workspace, size_t workspace_bytes,
                   cudaStream_t stream);

}  // namespace cuda
}  // namespace moe_xla

#endif  // MOE_XLA_CUDA_GATHER_GEMM_H_
