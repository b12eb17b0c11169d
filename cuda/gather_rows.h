// CUDA gather_rows for the contract in common/gather_rows.h. Framework-free: no XLA, no
// Python.
//
// Only enqueues work on `stream`: no host copy of device data, no synchronisation, no
// process-global state, so calls can be captured into a CUDA graph. Whatever src holds, no
// kernel reads or writes out of bounds. The kernel (cuda/row_gather.cuh, shared with
// permute) gives each row a team of threads that each keep several 16-byte loads in
// flight. Runs on GPUs of compute capability 8.x, 9.0 and 10.0 or later
// (cuda/device_support.h) and returns an error naming the capability on others.
#ifndef MOE_XLA_CUDA_GATHER_ROWS_H_
#define MOE_XLA_CUDA_GATHER_ROWS_H_

#include <cuda_runtime_api.h>

#include "common/gather_rows.h"
#include "common/status.h"

namespace moe_xla {
namespace cuda {

Status gather_rows(const GatherRowsParams& p, cudaStream_t stream);

}  // namespace cuda
}  // namespace moe_xla

#endif  // MOE_XLA_CUDA_GATHER_ROWS_H_
