// One explicit instantiation of our Hopper FP8 grouped-GEMM kernel (fp8_wgmma_kernel.cuh)
// for the output dtype given by -DMOE_XLA_CUTLASS_OUT_DTYPE, one compilation per entry of
// the instance table in cuda/BUILD.bazel.
#include "cuda/fp8_wgmma_kernel.cuh"

#if !defined(MOE_XLA_CUTLASS_OUT_DTYPE)
#error "set MOE_XLA_CUTLASS_OUT_DTYPE (kBF16 or kF32; cuda/BUILD.bazel)"
#endif

namespace moe_xla {
namespace cuda {
namespace detail {

template Status fp8_wgmma_run<DType::MOE_XLA_CUTLASS_OUT_DTYPE>(const Fp8WgmmaLaunch&);

}  // namespace detail
}  // namespace cuda
}  // namespace moe_xla
