// One explicit instantiation of our Hopper FP8 wgrad kernel (fp8_wgrad_wgmma_kernel.cuh)
// for the output dtype and tile width given by -DMOE_XLA_CUTLASS_OUT_DTYPE and
// -DMOE_XLA_CUTLASS_TILE_N, one compilation per entry of the instance table in
// cuda/BUILD.bazel.
#include "cuda/fp8_wgrad_wgmma_kernel.cuh"

#if !defined(MOE_XLA_CUTLASS_OUT_DTYPE) || !defined(MOE_XLA_CUTLASS_TILE_N)
#error "set MOE_XLA_CUTLASS_OUT_DTYPE (kBF16 or kF32) and MOE_XLA_CUTLASS_TILE_N (kN128 or kN192; cuda/BUILD.bazel)"
#endif

namespace moe_xla {
namespace cuda {
namespace detail {

template Status fp8_wgrad_wgmma_run<DType::MOE_XLA_CUTLASS_OUT_DTYPE, Fp8WgradTile::MOE_XLA_CUTLASS_TILE_N>(
    const Fp8WgradWgmmaLaunch&);

}  // namespace detail
}  // namespace cuda
}  // namespace moe_xla
