// One explicit instantiation of the CUTLASS FP8 wgrad (cutlass_fp8_wgrad.cuh): its output
// dtype and tile configuration come from -D flags, one compilation per entry of the
// wgrad instance table in cuda/BUILD.bazel.
#include "cuda/cutlass_fp8_wgrad.cuh"

#if !defined(MOE_XLA_CUTLASS_DTYPE) || !defined(MOE_XLA_CUTLASS_TILE)
#error "set MOE_XLA_CUTLASS_DTYPE and _TILE (e.g. kF32, kCoop128x128Cluster1x2; cuda/BUILD.bazel)"
#endif

namespace moe_xla {
namespace cuda {
namespace detail {

template size_t cutlass_fp8_wgrad_workspace_bytes<DType::MOE_XLA_CUTLASS_DTYPE,
                                                  Fp8TileConfig::MOE_XLA_CUTLASS_TILE>(int64_t, int);
template Status cutlass_fp8_wgrad_run<DType::MOE_XLA_CUTLASS_DTYPE, Fp8TileConfig::MOE_XLA_CUTLASS_TILE>(
    const CutlassFp8WgradArgs&);

}  // namespace detail
}  // namespace cuda
}  // namespace moe_xla
