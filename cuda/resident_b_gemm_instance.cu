// One explicit instantiation of our Hopper gmm kernel for a short K
// (resident_b_gemm_kernel.cuh) for the dtype given by -DMOE_XLA_CUTLASS_DTYPE, one
// compilation per entry of the instance table in cuda/BUILD.bazel.
#include "cuda/resident_b_gemm_kernel.cuh"

#if !defined(MOE_XLA_CUTLASS_DTYPE)
#error "set MOE_XLA_CUTLASS_DTYPE (kBF16; cuda/BUILD.bazel)"
#endif

namespace moe_xla {
namespace cuda {
namespace detail {

template Status resident_b_gemm_run<DType::MOE_XLA_CUTLASS_DTYPE>(const ResidentBLaunch&);

}  // namespace detail
}  // namespace cuda
}  // namespace moe_xla
