// XLA FFI handler of `after` (moe_xla/primitives/after.py), one symbol for the host and the
// CUDA platform: out = x, out being x's buffer (the call aliases them), once `dep` has been
// computed. It moves no data and launches nothing: its use is the data dependency on dep,
// which makes XLA schedule x's consumers after dep's producer.
// Not marked command-buffer compatible: XLA:GPU would record it into the step's CUDA graph
// by capturing a stream on which it enqueues nothing, which no GPU run has checked yet; as
// a thunk of its own it splits the step's command buffer there.
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace moe_xla {
namespace {

ffi::Error after(ffi::AnyBuffer x, ffi::AnyBuffer /*dep*/, ffi::Result<ffi::AnyBuffer> out) {
  if (out->untyped_data() != x.untyped_data()) {
    return ffi::Error::InvalidArgument("after: expected the result to alias x (operand 0), got another buffer");
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace moe_xla

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeXlaAfter, moe_xla::after,
                              xla::ffi::Ffi::Bind().Arg<xla::ffi::AnyBuffer>().Arg<xla::ffi::AnyBuffer>().Ret<
                                  xla::ffi::AnyBuffer>());
