// CUDA routing (route), dispatch (permute) and combine (unpermute) for the contracts in
// common/routing.h. Framework-free: no XLA, no Python.
//
// Every function only enqueues work on `stream`: no host copy of device data, no
// synchronisation, no process-global mutable state, so calls can be captured into a CUDA
// graph. Results are bitwise deterministic run to run (no float atomics, no atomics at
// all). Each returns a Status (common/status.h); whatever ids or row_map contain, no
// kernel reads or writes out of bounds. They run on GPUs of compute capability 8.x, 9.0
// and 10.0 or later (cuda/device_support.h) and return an error naming the capability on
// others.
//
//   route:     one warp per token; scores in shared memory, group filter and top-k by
//              repeated warp-wide argmax. Needs no workspace. Supports E up to 4096.
//   route_grad: one warp per token; sources and ids in shared memory, the
//              coefficients on lane 0, each lane its experts' d_logits. Needs no workspace.
//              Supports E and k up to 4096.
//   permute:   stable LSD radix sort (CUB) of (bucket(i), i) pairs, bucket = expert id or E
//              for invalid ids; group sizes by binary search on the sorted buckets; the
//              row gather of cuda/row_gather.cuh writes row_map and copies rows with
//              16-byte (or narrower) accesses. Needs permute_workspace_bytes(p) of workspace.
//   unpermute: a group of threads per token, vectorized loads, f32 accumulation in j
//              order (no FMA contraction, like the CPU kernel). Needs no workspace.
// permute's workspace pointer may have any alignment; its size must be at least
// permute_workspace_bytes of the same params.
#ifndef MOE_XLA_CUDA_ROUTING_H_
#define MOE_XLA_CUDA_ROUTING_H_

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "common/routing.h"
#include "common/status.h"

namespace moe_xla {
namespace cuda {

// Largest number of experts `route` supports (its per-token scores live in shared memory).
constexpr int64_t kRouteMaxExperts = 4096;

Status route(const RouteParams& p, cudaStream_t stream);

Status route_grad(const RouteGradParams& p, cudaStream_t stream);

// Host-only size query (CUB's temp storage query launches nothing and reads no device data).
size_t permute_workspace_bytes(const PermuteParams& p);
Status permute(const PermuteParams& p, void* workspace, size_t workspace_bytes, cudaStream_t stream);

Status unpermute(const UnpermuteParams& p, cudaStream_t stream);

}  // namespace cuda
}  // namespace moe_xla

#endif  // MOE_XLA_CUDA_ROUTING_H_
