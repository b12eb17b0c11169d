// Device pieces shared by the hand-written Hopper kernels whose producer warps gather
// operands with cp.async and whose consumer warp groups multiply them with wgmma
// (gather_gemm_kernel.cuh, gather_tgmm_kernel.cuh): the output element of a DType, the
// zero-filling 16-byte copy, the paired output store and the consumers' main loop.
#ifndef MOE_XLA_CUDA_WGMMA_KERNEL_PARTS_CUH_
#define MOE_XLA_CUDA_WGMMA_KERNEL_PARTS_CUH_

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cute/tensor.hpp"  // first: the atoms below rely on its declarations
#include "cute/algorithm/gemm.hpp"
#include "cute/atom/mma_atom.hpp"
#include "cutlass/arch/barrier.h"
#include "cutlass/cutlass.h"

#include "common/grouped_gemm.h"

namespace moe_xla {
namespace cuda {
namespace detail {

// The C++ element type of an output DType (bf16 or f32, the kernels' output dtypes).
template <DType kOut>
struct OutElement;
template <>
struct OutElement<DType::kBF16> {
  using type = __nv_bfloat16;
};
template <>
struct OutElement<DType::kF32> {
  using type = float;
};

// 16 bytes from global to shared memory, bypassing L1; src_bytes = 0 writes zeros and
// reads nothing.
__device__ __forceinline__ void cp_async_16_zfill(uint32_t smem_addr, const void* gmem,
                                                  uint32_t src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr), "l"(gmem),
               "r"(src_bytes)
               : "memory");
}

// Two consecutive output elements from two float32 accumulators (round to nearest even for
// bf16); `out` is aligned to the pair.
__device__ __forceinline__ void store_pair(__nv_bfloat16* out, float a, float b) {
  *reinterpret_cast<__nv_bfloat162*>(out) = __floats2bfloat162_rn(a, b);
}
__device__ __forceinline__ void store_pair(float* out, float a, float b) {
  *reinterpret_cast<float2*>(out) = make_float2(a, b);
}

// The consumer warp groups' main loop: `steps` >= 1 full pipeline stages from `read` on,
// each multiplied into `accum` with wgmma (both operands from shared memory, as fragments
// of descriptors (MMA, M|N, K, PIPE)); the first wgmma overwrites accum, the others add to
// it, so accum = sum over the stages in stage order. One batch of wgmma stays in flight: a
// stage is released once the batch that read it is done, the last one after all are.
// On return `read` is past the last stage and accum is final.
template <class Pipeline, class PipelineState, class TiledMma, class FragA, class FragB, class Accum>
__device__ __forceinline__ void wgmma_stages(Pipeline& pipeline, PipelineState& read, TiledMma& mma,
                                             const FragA& tCrA, const FragB& tCrB, Accum& accum,
                                             int64_t steps) {
  using namespace cute;
  PipelineState release = read;
  mma.accumulate_ = GMMA::ScaleOut::Zero;
  for (int64_t step = 0; step < steps; ++step) {
    pipeline.consumer_wait(read);
    // The stage was written by cp.async (generic proxy); wgmma reads through the async
    // proxy.
    cutlass::arch::fence_view_async_shared();
    const int stage = read.index();
    warpgroup_fence_operand(accum);
    warpgroup_arrive();
    CUTLASS_PRAGMA_UNROLL
    for (int k_block = 0; k_block < size<2>(tCrA); ++k_block) {
      gemm(mma, tCrA(_, _, k_block, stage), tCrB(_, _, k_block, stage), accum);
      mma.accumulate_ = GMMA::ScaleOut::One;
    }
    warpgroup_commit_batch();
    // One batch stays in flight; the one before it is done, so its stage is free.
    warpgroup_wait<1>();
    warpgroup_fence_operand(accum);
    if (step > 0) {
      pipeline.consumer_release(release);
      ++release;
    }
    ++read;
  }
  warpgroup_wait<0>();
  warpgroup_fence_operand(accum);
  pipeline.consumer_release(release);
}

}  // namespace detail
}  // namespace cuda
}  // namespace moe_xla

#endif  // MOE_XLA_CUDA_WGMMA_KERNEL_PARTS_CUH_
