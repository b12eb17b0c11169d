// Decodes and validates the buffers of the gather_rows FFI calls into the framework-free
// GatherRowsParams (common/gather_rows.h), for both the CPU and the CUDA handlers, and
// binds their operands. Every error names the argument, what was expected and what was
// passed.
#ifndef MOE_XLA_FFI_GATHER_ROWS_ARGS_H_
#define MOE_XLA_FFI_GATHER_ROWS_ARGS_H_

#include <optional>
#include <string>
#include <utility>

#include "common/gather_rows.h"
#include "ffi/grouped_gemm_args.h"  // shape_string, type_name, to_dtype, invalid, expect_shape
#include "xla/ffi/api/ffi.h"

namespace moe_xla::ffi_args {

namespace ffi = xla::ffi;

// values [T, H] of f32 / bf16 / f16; src [R] int32; factor [R] f32 or absent; rows [R, H]
// of values' dtype.
inline ffi::ErrorOr<GatherRowsParams> decode_gather_rows(ffi::AnyBuffer values, ffi::AnyBuffer src,
                                                         std::optional<ffi::AnyBuffer> factor, ffi::AnyBuffer rows) {
  const auto dims = values.dimensions();
  if (dims.size() != 2) return invalid("values: expected rank 2 [T, H], got shape " + shape_string(dims));
  auto dtype = to_dtype(values.element_type(), "values");
  if (dtype.has_error()) return ffi::Unexpected<ffi::Error>(dtype.error());
  if (src.dimensions().size() != 1) {
    return invalid("src: expected rank 1 [R], got shape " + shape_string(src.dimensions()));
  }
  if (src.element_type() != ffi::DataType::S32) {
    return invalid("src: expected dtype int32, got " + type_name(src.element_type()));
  }
  if (factor && factor->element_type() != ffi::DataType::F32) {
    return invalid("factor: expected dtype float32, got " + type_name(factor->element_type()));
  }
  if (rows.element_type() != values.element_type()) {
    return invalid("rows: expected dtype " + type_name(values.element_type()) + " (of values), got " +
                   type_name(rows.element_type()));
  }
  GatherRowsParams p{};
  p.num_values = dims[0];
  p.rows = src.dimensions()[0];
  p.cols = dims[1];
  if (factor) {
    if (auto e = expect_shape("factor", factor->dimensions(), {p.rows}); e.failure()) {
      return ffi::Unexpected<ffi::Error>(std::move(e));
    }
  }
  if (auto e = expect_shape("rows", rows.dimensions(), {p.rows, p.cols}); e.failure()) {
    return ffi::Unexpected<ffi::Error>(std::move(e));
  }
  p.values = values.untyped_data();
  p.dtype = *dtype;
  p.src = static_cast<const int32_t*>(src.untyped_data());
  p.factor = factor ? static_cast<const float*>(factor->untyped_data()) : nullptr;
  p.out = rows.untyped_data();
  return p;
}

// The operands of the gather_rows handlers, appended to `binding` (the CPU and CUDA
// handlers bind the same list, the CUDA one after its stream), in decode_gather_rows' order.
template <class Binding>
auto bind_gather_rows(Binding&& binding) {
  return std::move(binding)
      .template Arg<ffi::AnyBuffer>()           // values [T, H]
      .template Arg<ffi::AnyBuffer>()           // src [R] int32
      .template OptionalArg<ffi::AnyBuffer>()   // factor [R] float32, absent for a copy
      .template Ret<ffi::AnyBuffer>();          // rows [R, H], dtype of values
}

}  // namespace moe_xla::ffi_args

#endif  // MOE_XLA_FFI_GATHER_ROWS_ARGS_H_
