// CUDA kernels of the EP layer's dispatch plan for the contracts in common/ep_plan.h:
// ep_dedup_rows and ep_row_places. Framework-free: no XLA, no Python.
//
// One thread per token runs the contract's per-token function (the CPU kernels run the
// same one); ep_row_places first fills source and pairs in a kernel of its own. Only
// enqueues work on `stream`: no host copy of device data, no synchronisation, no atomics,
// so calls can be captured into a CUDA graph and results are the same run to run.
// Whatever the inputs hold, no kernel reads or writes out of bounds. Runs on GPUs of
// compute capability 8.x, 9.0 and 10.0 or later (cuda/device_support.h) and returns an
// error naming the capability on others.
#ifndef MOE_XLA_CUDA_EP_PLAN_H_
#define MOE_XLA_CUDA_EP_PLAN_H_

#include <cuda_runtime_api.h>

#include "common/ep_plan.h"
#include "common/status.h"

namespace moe_xla {
namespace cuda {

Status ep_dedup_rows(const EpDedupRowsParams& p, cudaStream_t stream);
Status ep_row_places(const EpRowPlacesParams& p, cudaStream_t stream);

}  // namespace cuda
}  // namespace moe_xla

#endif  // MOE_XLA_CUDA_EP_PLAN_H_
