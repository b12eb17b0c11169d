// Internal interface between the gather weight gradient's dispatcher (gather_tgmm.cu) and
// its Hopper kernel (gather_tgmm_kernel.cuh, compiled once per output dtype by
// gather_tgmm_instance.cu). Not part of the API.
#ifndef MOE_XLA_CUDA_GATHER_TGMM_INTERNAL_H_
#define MOE_XLA_CUDA_GATHER_TGMM_INTERNAL_H_

#include <cuda_runtime_api.h>

#include <cstdint>

#include "common/gather_tgmm.h"
#include "common/status.h"

namespace moe_xla {
namespace cuda {
namespace detail {

// Output block of one work unit: kGatherTgmmTileRows rows of out[g] (columns of x, or of
// dy for the transposed block) by kGatherTgmmTileCols columns (columns of dy, or of x),
// summed over the group's rows kGatherTgmmStepRows at a time.
constexpr int kGatherTgmmTileRows = 128;
constexpr int kGatherTgmmTileCols = 256;
constexpr int kGatherTgmmStepRows = 64;

// Rows [start, end) of a group after the clamp of common/gather_tgmm.h. The prep kernel
// writes one per group into the workspace.
struct alignas(8) GatherTgmmGroupRows {
  int32_t start;
  int32_t end;
};

struct GatherTgmmLaunch {
  const GatherTgmmParams* params;
  const GatherTgmmGroupRows* groups;  // device, [num_groups]
  // device, [num_groups]: a permutation of the groups, larger groups first (by size class,
  // see gather_tgmm.cu), so that the longest work units start first.
  const int32_t* order;
  int sm_count;
  cudaStream_t stream;
};

// Enqueues the kernel (gather_tgmm_kernel.cuh) with `kOut` output, after the prep kernel
// has written the groups' rows and order. Instantiated by gather_tgmm_instance.cu for the
// dtypes of the instance table in cuda/BUILD.bazel.
template <DType kOut>
Status gather_tgmm_kernel_run(const GatherTgmmLaunch& launch);

}  // namespace detail
}  // namespace cuda
}  // namespace moe_xla

#endif  // MOE_XLA_CUDA_GATHER_TGMM_INTERNAL_H_
