// XLA FFI handler of route on CUDA: decodes, validates and enqueues cuda::route on XLA's
// stream (no host sync, no scratch needed; command-buffer compatible).
#include <cuda_runtime_api.h>

#include <string>

#include "cuda/routing.h"
#include "ffi/routing_args.h"
#include "ffi/status.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace moe_xla {
namespace {

ffi::Error route_cuda(cudaStream_t stream, ffi::AnyBuffer logits,
                      ffi::RemainingArgs bias, ffi::ResultBuffer<ffi::F32> weights,
                      ffi::ResultBuffer<ffi::S32> expert_ids, int64_t top_k, int64_t score, int64_t n_groups,
                      int64_t topk_groups, bool renormalize, float scale) {
  auto p = ffi_args::decode_route(logits, bias, *weights, *expert_ids, top_k, score, n_groups, topk_groups,
                                  renormalize, scale);
  if (p.has_error()) return p.error();
  if (p->experts > cuda::kRouteMaxExperts) {
    return ffi::Error::InvalidArgument("logits: the CUDA route supports at most " +
                                       std::to_string(cuda::kRouteMaxExperts) + " experts, got " +
                                       std::to_string(p->experts));
  }
  return ffi_args::to_error(cuda::route(*p, stream), "route");
}

}  // namespace
}  // namespace moe_xla

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeXlaRouteCudaV2, moe_xla::route_cuda,
                              moe_xla::ffi_args::bind_route(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});
