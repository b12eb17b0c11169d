// Internal interface between the gather GEMM's dispatcher (gather_gemm.cu) and its Hopper
// kernel (gather_gemm_kernel.cuh, compiled once per output dtype, layout of w and epilogue
// by gather_gemm_instance.cu). Not part of the API.
#ifndef MOE_XLA_CUDA_GATHER_GEMM_INTERNAL_H_
#define MOE_XLA_CUDA_GATHER_GEMM_INTERNAL_H_

#include <cuda_runtime_api.h>

#include <cstdint>

#include "common/gather_gemm.h"
#include "common/status.h"

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

// One row tile of the product: rows [row_begin, row_end) of group `group`, at most
// kGatherTileM of them. The prep kernels write one per row tile of every group, group by
// group, in a table of the workspace.
struct alignas(16) GatherRowTile {
  int32_t group;
  int32_t row_begin;
  int32_t row_end;
  int32_t unused;
};

// Written by the prep kernels next to the table: how many row tiles it holds, and the
// rows the groups cover (rows [covered, M) are zero).
struct alignas(16) GatherTileCount {
  int64_t row_tiles;
  int64_t covered;
};

struct GatherGemmLaunch {
  const GatherGemmParams* params;
  const GatherRowTile* row_tiles;     // device
  const GatherTileCount* tile_count;  // device
  int64_t max_row_tiles;              // an upper bound of tile_count->row_tiles
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
