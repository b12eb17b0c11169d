// Decodes and validates what the expert activation kernels' FFI calls share (the
// activation attribute and its input h), and the buffers of the activate_weighted_grad
// calls into ActivateWeightedGradParams (common/expert_activation.h), for both the CPU
// and the CUDA handlers. Every error names the argument, what was expected and what was
// passed.
#ifndef MOE_XLA_FFI_ACTIVATION_ARGS_H_
#define MOE_XLA_FFI_ACTIVATION_ARGS_H_

#include <cstdint>
#include <initializer_list>
#include <string>
#include <tuple>
#include <utility>

#include "common/expert_activation.h"
#include "ffi/grouped_gemm_args.h"  // shape_string, type_name, to_dtype, invalid, expect_shape
#include "xla/ffi/api/ffi.h"

namespace moe_xla::ffi_args {

namespace ffi = xla::ffi;

// The expert activation and its input h [M, 2F] (gated) or [M, F] of f32 / bf16 / f16:
// activation one of common/expert_activation.h; rows M, h_cols h's last dim.
struct ActivationInput {
  Activation activation;
  int64_t rows, h_cols;
  DType dtype;
};

inline ffi::ErrorOr<ActivationInput> decode_activation_input(ffi::AnyBuffer h, int32_t activation) {
  if (activation < 0 || activation >= kNumActivations) {
    return invalid("activation: expected 0 .. " + std::to_string(kNumActivations - 1) + ", got " +
                   std::to_string(activation));
  }
  const auto dims = h.dimensions();
  if (dims.size() != 2) return invalid("h: expected rank 2 [M, 2F] or [M, F], got shape " + shape_string(dims));
  const auto act = static_cast<Activation>(activation);
  if (is_gated(act) && dims[1] % 2 != 0) {
    return invalid("h: expected an even last dim (gate | up), got " + shape_string(dims));
  }
  auto dtype = to_dtype(h.element_type(), "h");
  if (dtype.has_error()) return ffi::Unexpected<ffi::Error>(dtype.error());
  return ActivationInput{act, dims[0], dims[1], *dtype};
}

// Each of `buffers` (name, buffer) of h's dtype, or the error naming the first that is not.
inline ffi::Error expect_dtype_of_h(ffi::AnyBuffer h,
                                    std::initializer_list<std::pair<const char*, ffi::AnyBuffer>> buffers) {
  for (const auto& [name, b] : buffers) {
    if (b.element_type() != h.element_type()) {
      return ffi::Error::InvalidArgument(std::string(name) + ": expected the dtype of h " +
                                         type_name(h.element_type()) + ", got " + type_name(b.element_type()));
    }
  }
  return ffi::Error::Success();
}

// h [M, 2F] (gated) or [M, F]; g [M, F], dh [M, C] (C: h's last dim) and weighted [M, F]
// of h's dtype; omega and d_omega [M] f32.
inline ffi::ErrorOr<ActivateWeightedGradParams> decode_activate_weighted_grad(ffi::AnyBuffer h, ffi::AnyBuffer g,
                                                                             ffi::Buffer<ffi::F32> omega,
                                                                             ffi::AnyBuffer dh,
                                                                             ffi::Buffer<ffi::F32> d_omega,
                                                                             ffi::AnyBuffer weighted,
                                                                             int32_t activation) {
  auto in = decode_activation_input(h, activation);
  if (in.has_error()) return ffi::Unexpected<ffi::Error>(in.error());
  ActivateWeightedGradParams p{};
  p.activation = in->activation;
  p.rows = in->rows;
  p.cols = in->h_cols;
  const int64_t f = is_gated(p.activation) ? p.cols / 2 : p.cols;
  if (auto e = expect_dtype_of_h(h, {{"g", g}, {"dh", dh}, {"weighted", weighted}}); e.failure()) {
    return ffi::Unexpected<ffi::Error>(std::move(e));
  }
  for (auto [name, got, want] : {std::tuple{"g", g.dimensions(), f}, std::tuple{"dh", dh.dimensions(), p.cols},
                                 std::tuple{"weighted", weighted.dimensions(), f}}) {
    if (auto e = expect_shape(name, got, {p.rows, want}); e.failure()) return ffi::Unexpected<ffi::Error>(std::move(e));
  }
  for (auto [name, got] : {std::pair{"omega", omega.dimensions()}, std::pair{"d_omega", d_omega.dimensions()}}) {
    if (auto e = expect_shape(name, got, {p.rows}); e.failure()) return ffi::Unexpected<ffi::Error>(std::move(e));
  }
  p.h = h.untyped_data();
  p.g = g.untyped_data();
  p.omega = omega.typed_data();
  p.dtype = in->dtype;
  p.dh = dh.untyped_data();
  p.d_omega = d_omega.typed_data();
  p.weighted = weighted.untyped_data();
  return p;
}

// The operands and attributes of the activate_weighted_grad handlers, appended to
// `binding` (the CUDA handler's after its stream), in decode_activate_weighted_grad's order.
template <class Binding>
auto bind_activate_weighted_grad(Binding&& binding) {
  return std::move(binding)
      .template Arg<ffi::AnyBuffer>()          // h [M, 2F] or [M, F]
      .template Arg<ffi::AnyBuffer>()          // g [M, F], dtype of h
      .template Arg<ffi::Buffer<ffi::F32>>()   // omega [M]
      .template Ret<ffi::AnyBuffer>()          // dh, shape and dtype of h
      .template Ret<ffi::Buffer<ffi::F32>>()   // d_omega [M]
      .template Ret<ffi::AnyBuffer>()          // weighted [M, F], dtype of h; may alias g
      .template Attr<int32_t>("activation");
}

}  // namespace moe_xla::ffi_args

#endif  // MOE_XLA_FFI_ACTIVATION_ARGS_H_
