// XLA FFI handler of route_grad on the host platform.
#include "cpu/route_grad.h"
#include "ffi/routing_args.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace moe_xla {
namespace {

ffi::Error route_grad_cpu(ffi::AnyBuffer logits, ffi::Buffer<ffi::S32> expert_ids, ffi::Buffer<ffi::F32> d_weights,
                          ffi::Result<ffi::AnyBuffer> d_logits, int64_t score, bool renormalize, float scale) {
  auto p = ffi_args::decode_route_grad(logits, expert_ids, d_weights, d_logits, score, renormalize, scale);
  if (p.has_error()) return p.error();
  cpu::route_grad(*p);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace moe_xla

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeXlaRouteGradCpu, moe_xla::route_grad_cpu,
                              moe_xla::ffi_args::bind_route_grad(ffi::Ffi::Bind()));
