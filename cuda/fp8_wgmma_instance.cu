// One explicit instantiation of our Hopper FP8 grouped-GEMM kernel (fp8_wgmma_kernel.cuh)
// for the output dtype and tile width given by -DMOE_XLA_CUTLASS_OUT_DTYPE and
// -DMOE_XLA_CUTLASS_TILE_N, one compilation per entry of the instance table in
// cuda/BUILD.bazel.
#include "cuda/fp8_wgmma_kernel.cuh"

#if !defined(MOE_XLA_CUTLASS_OUT_DTYPE) || !defined(MOE_XLA_CUTLASS_TILE_N)
#error "set MOE_XLA_CUTLASS_OUT_DTYPE (kBF16 or kF32) and MOE_XLA_CUTLASS_TILE_N (kN128, kN192 or kN192Bulk; cuda/BUILD.bazel)"
#endif

namespace moe_xla {
namespace cuda {
namespace detail {

template Status fp8_wgmma_run<DType::MOE_XLA_CUTLASS_OUT_DTYPE, Fp8WgmmaTile::MOE_XLA_CUTLASS_TILE_N>(
    const Fp8WgmmaLaunch&);

}  // namespace detail
}  // namespace cuda
}  // namespace moe_xla
