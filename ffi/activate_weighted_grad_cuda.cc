// XLA FFI handler of activate_weighted_grad on CUDA: decodes, validates and enqueues
// cuda::activate_weighted_grad on XLA's stream (no host sync; command-buffer compatible).
#include <cuda_runtime_api.h>

#include <cstdint>

#include "cuda/activate_weighted_grad.h"
#include "ffi/activation_args.h"
#include "ffi/status.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace moe_xla {
namespace {

ffi::Error activate_weighted_grad_cuda(cudaStream_t stream, ffi::AnyBuffer h, ffi::AnyBuffer g,
                                       ffi::Buffer<ffi::F32> omega, ffi::Result<ffi::AnyBuffer> dh,
                                       ffi::ResultBuffer<ffi::F32> d_omega, ffi::Result<ffi::AnyBuffer> weighted,
                                       int32_t activation) {
  auto p = ffi_args::decode_activate_weighted_grad(h, g, omega, *dh, *d_omega, *weighted, activation);
  if (p.has_error()) return p.error();
  return ffi_args::to_error(cuda::activate_weighted_grad(*p, stream), "activate_weighted_grad");
}

}  // namespace
}  // namespace moe_xla

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeXlaActivateWeightedGradCudaV2, moe_xla::activate_weighted_grad_cuda,
                              moe_xla::ffi_args::bind_activate_weighted_grad(
                                  ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});
