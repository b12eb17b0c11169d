// Internal interface between the gather GEMM's dispatcher (gather_gemm.cu) and its Hopper
// kernel (gather_gemm_kernel.cuh, compiled once per output dtype, layout of w and epilogue
// by gather_gemm_instance.cu). Not part of the API.
#ifndef MOE_XLA_CUDA_GATHER_GEMM_INTERNAL_H_
#define MOE_XLA_CUDA_GATHER_GEMM_INTERNAL_H_

#include <cuda_runtime_api.h>

#include <cstdint>

#include "common/gather_gemm.h"
#include "common/status.h"
#include "cuda/row_tiles.h"

namespace moe_xla {
namespace cuda {
namespace detail {

// Output tile of one CTA: kGatherTileM rows of one group by kGatherTileN columns.
constexpr int kGatherTileM = 128;
constexpr int kGatherTileN = 256;

// What the consumers do with a tile's float32 accumulators before the one rounding to the
// output (common/gather_gemm.h): store them (kNone), store g of them (kPlain: gelu, silu,
// relu) or store g(gate) * up (kGated: swiglu, geglu), the activation read at run time.
enum class GatherEpilogue { kNone, kPlain, kGated };

struct GatherGemmLaunch {
  const GatherGemmParams* params;
  RowTileTable row_tiles;  // of kGatherTileM rows
  int sm_count;
  cudaStream_t stream;
};

// Enqueues the GEMM kernel (gather_gemm_kernel.cuh) with `kOut` output, w in `kLayout`
// (kGmm: [G, K, N]; kGmmTransposed: [G, N, K], params->transpose_w) and `kEpilogue`, after
// the prep kernels have written the tile table. Instantiated by gather_gemm_instance.cu for
// the (dtype, layout, epilogue) entries of the instance table in cuda/BUILD.bazel.
template <DType kOut, GroupedLayout kLayout, GatherEpilogue kEpilogue>
Status gather_gemm_kernel_run(const GatherGemmLaunch& launch);

}  // namespace detail
}  // namespace cuda
}  // namespace moe_xla

#endif  // MOE_XLA_CUDA_GATHER_GEMM_INTERNAL_H_
