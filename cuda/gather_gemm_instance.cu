// One explicit instantiation of the gather GEMM's Hopper kernel (gather_gemm_kernel.cuh)
// for the output dtype given by -DMOE_XLA_CUTLASS_OUT_DTYPE, the layout of w given by
// -DMOE_XLA_CUTLASS_LAYOUT (kGmm: w [G, K, N]; kGmmTransposed: w [G, N, K]) and the
// epilogue given by -DMOE_XLA_CUTLASS_EPILOGUE (a GatherEpilogue), one compilation per
// entry of the instance table in cuda/BUILD.bazel.
#include "cuda/gather_gemm_kernel.cuh"

#if !defined(MOE_XLA_CUTLASS_OUT_DTYPE) || !defined(MOE_XLA_CUTLASS_LAYOUT) || !defined(MOE_XLA_CUTLASS_EPILOGUE)
#error "set MOE_XLA_CUTLASS_OUT_DTYPE (kBF16 or kF32), MOE_XLA_CUTLASS_LAYOUT (kGmm or kGmmTransposed) and MOE_XLA_CUTLASS_EPILOGUE (kNone, kPlain or kGated; cuda/BUILD.bazel)"
#endif

namespace moe_xla {
namespace cuda {
namespace detail {

template Status gather_gemm_kernel_run<DType::MOE_XLA_CUTLASS_OUT_DTYPE, GroupedLayout::MOE_XLA_CUTLASS_LAYOUT,
                                       GatherEpilogue::MOE_XLA_CUTLASS_EPILOGUE>(const GatherGemmLaunch&);

}  // namespace detail
}  // namespace cuda
}  // namespace moe_xla
