// XLA FFI handler of activate_weighted_grad on the host platform.
#include <cstdint>

#include "cpu/activate_weighted_grad.h"
#include "ffi/activation_args.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace moe_xla {
namespace {

ffi::Error activate_weighted_grad_cpu(ffi::AnyBuffer h, ffi::AnyBuffer g, ffi::Buffer<ffi::F32> omega,
                                      ffi::Result<ffi::AnyBuffer> dh, ffi::ResultBuffer<ffi::F32> d_omega,
                                      ffi::Result<ffi::AnyBuffer> weighted, int32_t activation) {
  auto p = ffi_args::decode_activate_weighted_grad(h, g, omega, *dh, *d_omega, *weighted, activation);
  if (p.has_error()) return p.error();
  cpu::activate_weighted_grad(*p);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace moe_xla

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeXlaActivateWeightedGradCpuV2, moe_xla::activate_weighted_grad_cpu,
                              moe_xla::ffi_args::bind_activate_weighted_grad(ffi::Ffi::Bind()));
