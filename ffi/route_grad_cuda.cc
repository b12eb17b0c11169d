// XLA FFI handler of route_grad on CUDA: decodes, validates and enqueues cuda::route_grad
// on XLA's stream (no host sync, no scratch; command-buffer compatible).
#include <cuda_runtime_api.h>

#include "cuda/routing.h"
#include "ffi/routing_args.h"
#include "ffi/status.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace moe_xla {
namespace {

ffi::Error route_grad_cuda(cudaStream_t stream, ffi::AnyBuffer logits, ffi::Buffer<ffi::S32> expert_ids,
                           ffi::Buffer<ffi::F32> d_weights, ffi::Result<ffi::AnyBuffer> d_logits, int64_t score,
                           bool renormalize, float scale) {
  auto p = ffi_args::decode_route_grad(logits, expert_ids, d_weights, d_logits, score, renormalize, scale);
  if (p.has_error()) return p.error();
  return ffi_args::to_error(cuda::route_grad(*p, stream), "route_grad");
}

}  // namespace
}  // namespace moe_xla

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeXlaRouteGradCuda, moe_xla::route_grad_cuda,
                              moe_xla::ffi_args::bind_route_grad(
                                  ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});
