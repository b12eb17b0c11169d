// Internal interface between the FP8 wgrad dispatcher (fp8_wgrad.cu) and our Hopper FP8
// wgrad kernel (fp8_wgrad_wgmma_kernel.cuh, compiled once per output dtype and tile width
// by fp8_wgrad_wgmma_instance.cu). Not part of the API.
#ifndef MOE_XLA_CUDA_FP8_WGRAD_WGMMA_INTERNAL_H_
#define MOE_XLA_CUDA_FP8_WGRAD_WGMMA_INTERNAL_H_

#include <cuda_runtime_api.h>

#include <cstdint>

#include "common/fp8_grouped_gemm.h"
#include "common/status.h"

namespace moe_xla {
namespace cuda {
namespace detail {

// Columns of the kernel's 128-row output tile.
enum class Fp8WgradTile : int32_t { kN128, kN192 };

struct Fp8WgradWgmmaLaunch {
  const Fp8WgradParams* params;
  const int64_t* group_tiles;  // [G][2] on the device: each group's first tile and tile count
  cudaStream_t stream;
};

// Enqueues the kernel with `kOut` output and `kTile` columns per tile, after the kernel
// that writes `group_tiles`. Needs K % 4 == 0 and N % 8 == 0, 16-byte aligned operands,
// scales and output (the dispatcher checks). Instantiated by fp8_wgrad_wgmma_instance.cu
// for the entries of cuda/BUILD.bazel's table.
template <DType kOut, Fp8WgradTile kTile>
Status fp8_wgrad_wgmma_run(const Fp8WgradWgmmaLaunch& launch);

}  // namespace detail
}  // namespace cuda
}  // namespace moe_xla

#endif  // MOE_XLA_CUDA_FP8_WGRAD_WGMMA_INTERNAL_H_
