// One explicit instantiation of the CUTLASS grouped GEMM (cutlass_grouped.cuh): its dtype,
// layout and tile configuration come from -D flags, one compilation per entry of the
// instance table in cuda/BUILD.bazel (the cutlass_instances rule of bazel/cuda.bzl).
#include "cuda/cutlass_grouped.cuh"

#if !defined(MOE_XLA_CUTLASS_DTYPE) || !defined(MOE_XLA_CUTLASS_LAYOUT) || \
    !defined(MOE_XLA_CUTLASS_TILE)
#error "set MOE_XLA_CUTLASS_DTYPE, _LAYOUT and _TILE (e.g. kBF16, kGmm, kLarge; cuda/BUILD.bazel)"
#endif

namespace moe_xla {
namespace cuda {
namespace detail {

template size_t cutlass_grouped_workspace_bytes<DType::MOE_XLA_CUTLASS_DTYPE,
                                                GroupedLayout::MOE_XLA_CUTLASS_LAYOUT,
                                                TileConfig::MOE_XLA_CUTLASS_TILE>(int64_t, int);
template Status cutlass_grouped_run<DType::MOE_XLA_CUTLASS_DTYPE,
                                    GroupedLayout::MOE_XLA_CUTLASS_LAYOUT,
                                    TileConfig::MOE_XLA_CUTLASS_TILE>(const CutlassGroupedArgs&);

}  // namespace detail
}  // namespace cuda
}  // namespace moe_xla
