// The optional float32 operand a handler takes last, through ffi::RemainingArgs (route's
// bias, unpermute's weights, expand_quantize_fp8_rows' factor): decoded and checked in one
// place, so that every such handler has the same checks and messages.
#ifndef MOE_XLA_FFI_OPTIONAL_OPERAND_H_
#define MOE_XLA_FFI_OPTIONAL_OPERAND_H_

#include <optional>
#include <string>

#include "ffi/grouped_gemm_args.h"  // invalid, type_name
#include "xla/ffi/api/ffi.h"

namespace moe_xla::ffi_args {

namespace ffi = xla::ffi;

// The handler's remaining operands `rest` hold the operand `name` or nothing: nullopt where
// nothing was passed, else the buffer, which is float32 (its shape is the caller's to
// check). An error names the op, the operand before it, the operand and its expected shape.
inline ffi::ErrorOr<std::optional<ffi::AnyBuffer>> optional_f32_operand(ffi::RemainingArgs rest, const std::string& op,
                                                                        const std::string& before,
                                                                        const std::string& name,
                                                                        const std::string& shape) {
  if (rest.size() > 1) {
    return invalid(op + ": expected at most one operand after " + before + " (" + name + "), got " +
                   std::to_string(rest.size()));
  }
  if (rest.size() == 0) return std::optional<ffi::AnyBuffer>();
  auto b = rest.get<ffi::AnyBuffer>(0);
  if (b.has_error()) return invalid(name + ": expected a float32 buffer " + shape);
  if (b->element_type() != ffi::DataType::F32) {
    return invalid(name + ": expected float32, got " + type_name(b->element_type()));
  }
  return std::optional<ffi::AnyBuffer>(*b);
}

}  // namespace moe_xla::ffi_args

#endif  // MOE_XLA_FFI_OPTIONAL_OPERAND_H_
