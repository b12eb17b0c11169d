// XLA FFI handler of gather_rows on the host platform.
#include <optional>

#include "cpu/gather_rows.h"
#include "ffi/gather_rows_args.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace moe_xla {
namespace {

ffi::Error gather_rows_cpu(ffi::AnyBuffer values, ffi::AnyBuffer src, std::optional<ffi::AnyBuffer> factor,
                           ffi::Result<ffi::AnyBuffer> rows) {
  auto p = ffi_args::decode_gather_rows(values, src, factor, *rows);
  if (p.has_error()) return p.error();
  cpu::gather_rows(*p);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace moe_xla

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeXlaGatherRowsCpu, moe_xla::gather_rows_cpu,
                              moe_xla::ffi_args::bind_gather_rows(ffi::Ffi::Bind()));
