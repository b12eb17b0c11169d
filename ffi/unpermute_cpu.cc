// XLA FFI handler of unpermute (combine) on the host platform.
#include "cpu/unpermute.h"
#include "ffi/routing_args.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace moe_xla {
namespace {

ffi::Error unpermute_cpu(ffi::AnyBuffer y_sorted, ffi::Buffer<ffi::S32> row_map, ffi::RemainingArgs weights,
                         ffi::Result<ffi::AnyBuffer> y) {
  auto p = ffi_args::decode_unpermute(y_sorted, row_map, weights, *y);
  if (p.has_error()) return p.error();
  cpu::unpermute(*p);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace moe_xla

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeXlaUnpermuteCpuV2, moe_xla::unpermute_cpu,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()          // y_sorted [R, H]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // row_map [T*k]
                                  .RemainingArgs()                // weights [T, k], or none: every weight 1
                                  .Ret<ffi::AnyBuffer>());        // y [T, H]
