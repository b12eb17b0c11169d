// One explicit instantiation of the gather weight gradient's Hopper kernel
// (gather_tgmm_kernel.cuh) for the output dtype given by -DMOE_XLA_CUTLASS_OUT_DTYPE, one
// compilation per entry of the instance table in cuda/BUILD.bazel.
#include "cuda/gather_tgmm_kernel.cuh"

#if !defined(MOE_XLA_CUTLASS_OUT_DTYPE)
#error "set MOE_XLA_CUTLASS_OUT_DTYPE (kBF16 or kF32; cuda/BUILD.bazel)"
#endif

namespace moe_xla {
namespace cuda {
namespace detail {

template Status gather_tgmm_kernel_run<DType::MOE_XLA_CUTLASS_OUT_DTYPE>(const GatherTgmmLaunch&);

}  // namespace detail
}  // namespace cuda
}  // namespace moe_xla
