// One explicit instantiation of the CUTLASS grouped GEMM (cutlass_grouped.cuh): its dtype,
// layout and tile configuration come from -D flags that cuda/cutlass_instances.bzl sets,
// one compilation per entry of its table.
#include "cuda/cutlass_grouped.cuh"

#if !defined(MOE_XLA_CUTLASS_DTYPE) || !defined(MOE_XLA_CUTLASS_LAYOUT) || \
    !defined(MOE_XLA_CUTLASS_TILE)
#error "compile with -DMOE_XLA_CUTLASS_DTYPE=kBF16 -DMOE_XLA_CUTLASS_LAYOUT=kGmm -DMOE_XLA_CUTLASS_TILE=kLarge (see cuda/cutlass_instances.bzl)"
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
