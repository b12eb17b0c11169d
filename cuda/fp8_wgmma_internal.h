// Internal interface between the FP8 dispatcher (fp8_grouped_gemm.cu) and our Hopper FP8
// kernel (fp8_wgmma_kernel.cuh, compiled once per output dtype and tile width by
// fp8_wgmma_instance.cu).
// Not part of the API.
#ifndef MOE_XLA_CUDA_FP8_WGMMA_INTERNAL_H_
#define MOE_XLA_CUDA_FP8_WGMMA_INTERNAL_H_

#include <cuda_runtime_api.h>

#include "common/fp8_grouped_gemm.h"
#include "common/status.h"
#include "cuda/row_tiles.h"

namespace moe_xla {
namespace cuda {
namespace detail {

// Rows of the kernel's output tile: the row tiles of its table have this height.
constexpr int kFp8WgmmaTileM = 128;

// The kernel's output tile: its columns (fp8_wgmma_columns) and how it is stored.
// kN192Bulk is kN192 with the whole tile staged in shared memory and written by bulk
// copies that run on while the next tile is computed (bf16 output only; one pipeline
// stage fewer to make room).
enum class Fp8WgmmaTile : int32_t {
  kN128,
  kN192,
  kN192Bulk,
};

constexpr int fp8_wgmma_columns(Fp8WgmmaTile tile) { return tile == Fp8WgmmaTile::kN128 ? 128 : 192; }

struct Fp8WgmmaLaunch {
  const Fp8GroupedGemmParams* params;
  RowTileTable row_tiles;  // of kFp8WgmmaTileM rows
  int sm_count;
  cudaStream_t stream;
};

// Enqueues the kernel with `kOut` output and `kTile` columns per tile after the row-tile
// table's kernels. Instantiated by fp8_wgmma_instance.cu for the entries of
// cuda/BUILD.bazel's table.
template <DType kOut, Fp8WgmmaTile kTile>
Status fp8_wgmma_run(const Fp8WgmmaLaunch& launch);

}  // namespace detail
}  // namespace cuda
}  // namespace moe_xla

#endif  // MOE_XLA_CUDA_FP8_WGMMA_INTERNAL_H_
