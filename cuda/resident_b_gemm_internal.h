// Internal interface between the grouped-GEMM dispatcher (grouped_gemm.cu) and our Hopper
// kernel for gmm with a short K (resident_b_gemm_kernel.cuh, one compilation of
// resident_b_gemm_instance.cu per entry of its table in cuda/BUILD.bazel). Not part of the
// API.
#ifndef MOE_XLA_CUDA_RESIDENT_B_GEMM_INTERNAL_H_
#define MOE_XLA_CUDA_RESIDENT_B_GEMM_INTERNAL_H_

#include <cuda_runtime_api.h>

#include <cstdint>

#include "common/grouped_gemm.h"
#include "common/status.h"
#include "cuda/row_tiles.h"

namespace moe_xla {
namespace cuda {
namespace detail {

// The kernel's shapes: a work unit is one row tile of at most kResidentUnitRows rows of one
// group and one kResidentTileN-column tile of the output; its B block, rhs[g, 0 : K, n0 :
// n0 + kResidentTileN], stays in shared memory while the unit's rows stream past it, so K
// is at most kResidentMaxK.
constexpr int kResidentTileN = 256;
constexpr int kResidentMaxK = 256;
constexpr int kResidentUnitRows = 2048;

struct ResidentBLaunch {
  const GroupedGemmParams* params;  // layout kGmm, in and out dtype the instance's
  RowTileTable row_tiles;           // of kResidentUnitRows rows
  int sm_count;
  cudaStream_t stream;
};

// Enqueues the kernel (after the row-tile table's kernels, which also zeroed the output
// rows past the groups). Instantiated by resident_b_gemm_instance.cu.
template <DType kDType>
Status resident_b_gemm_run(const ResidentBLaunch& launch);

}  // namespace detail
}  // namespace cuda
}  // namespace moe_xla

#endif  // MOE_XLA_CUDA_RESIDENT_B_GEMM_INTERNAL_H_
