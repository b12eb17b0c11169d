// CUDA gather weight gradient for the contract in common/gather_tgmm.h: the gradient of the
// first expert GEMM of a MoE layer with respect to its weights,
//   out[g] = sum over the rows r of group g of x[src[r]]^T (outer) dy[r],
// reading the rows x[src[r]] straight from the tokens instead of from a gathered copy.
// Framework-free: no XLA, no Python.
//
// Hopper only (compute capability 9.0): a warp-specialised persistent kernel whose
// producer warps copy the group's rows of x (through src) and of dy with cp.async and
// whose consumer warp groups multiply them with wgmma (cuda/gather_tgmm_kernel.cuh).
// bf16 x and dy, float32 accumulation, bf16 or f32 output. Deterministic: every output
// element is summed by one CTA, over the group's rows in order.
//
// Requirements, each an InvalidArgument error when not met: K and N multiples of 8 (rows
// of x, dy and out of whole 16-byte chunks, as cp.async reads them); x, dy and out 16-byte
// aligned; T, M, K, N and G at most 2^31 - 256.
//
// Everything is enqueued on the given stream: group sizes stay on the device (a prep
// kernel turns them into the groups' rows and an order of the groups in the workspace),
// no host synchronisation, no process-global mutable state, so the launch can be captured
// into a CUDA graph. Whatever group_sizes and src hold, nothing is read or written out of
// bounds.
#ifndef MOE_XLA_CUDA_GATHER_TGMM_H_
#define MOE_XLA_CUDA_GATHER_TGMM_H_

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "common/gather_tgmm.h"
#include "common/status.h"

namespace moe_xla {
namespace cuda {

// Bytes of device scratch `gather_tgmm` needs for these params (the groups' rows and their
// order, plus alignment slack); 0 for params it rejects. Any alignment of the scratch
// pointer is accepted.
size_t gather_tgmm_workspace_bytes(const GatherTgmmParams& p);

// The same for any params of G groups it accepts: the scratch depends on G only (so a
// caller can size it before knowing the rest); 0 when G is out of range.
size_t gather_tgmm_workspace_bytes(int64_t num_groups);

// Enqueues out = gather weight gradient (common/gather_tgmm.h) on `stream`, on the current
// device. The workspace holds at least gather_tgmm_workspace_bytes(p) bytes.
Status gather_tgmm(const GatherTgmmParams& p, void* workspace, size_t workspace_bytes,
                   cudaStream_t stream);

}  // namespace cuda
}  // namespace moe_xla

#endif  // MOE_XLA_CUDA_GATHER_TGMM_H_
