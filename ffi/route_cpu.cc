// XLA FFI handler of route on the host platform.
#include "cpu/route.h"
#include "ffi/routing_args.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace moe_xla {
namespace {

ffi::Error route_cpu(ffi::AnyBuffer logits, ffi::RemainingArgs bias, ffi::ResultBuffer<ffi::F32> weights,
                     ffi::ResultBuffer<ffi::S32> expert_ids, int64_t top_k, int64_t score, int64_t n_groups,
                     int64_t topk_groups, bool renormalize, float scale) {
  auto p = ffi_args::decode_route(logits, bias, *weights, *expert_ids, top_k, score, n_groups, topk_groups,
                                  renormalize, scale);
  if (p.has_error()) return p.error();
  cpu::route(*p);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace moe_xla

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeXlaRouteCpuV2, moe_xla::route_cpu, moe_xla::ffi_args::bind_route(ffi::Ffi::Bind()));
