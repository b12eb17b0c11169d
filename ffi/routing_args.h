// Decodes and validates the buffers and attributes of the route / permute / unpermute FFI
// calls into the framework-free params of common/routing.h, for both the CPU and the CUDA
// handlers. Every error names the argument, what was expected and what was passed.
#ifndef MOE_XLA_FFI_ROUTING_ARGS_H_
#define MOE_XLA_FFI_ROUTING_ARGS_H_

#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <utility>

#include "common/routing.h"
#include "ffi/grouped_gemm_args.h"  // shape_string, type_name, to_dtype, invalid, expect_shape
#include "ffi/optional_operand.h"   // optional_f32_operand
#include "xla/ffi/api/ffi.h"

namespace moe_xla::ffi_args {

namespace ffi = xla::ffi;

inline ffi::Unexpected<ffi::Error> unexpected(ffi::Error e) { return ffi::Unexpected<ffi::Error>(std::move(e)); }

// logits [T, E] of route and route_grad: (T, E, dtype), E in [1, 2^31).
struct LogitsShape {
  int64_t tokens, experts;
  DType dtype;
};

inline ffi::ErrorOr<LogitsShape> decode_logits(ffi::AnyBuffer logits) {
  const auto dims = logits.dimensions();
  if (dims.size() != 2) return invalid("logits: expected rank 2 [T, E], got shape " + shape_string(dims));
  auto dtype = to_dtype(logits.element_type(), "logits");
  if (dtype.has_error()) return unexpected(dtype.error());
  if (dims[1] < 1) return invalid("logits: expected at least one expert, got shape " + shape_string(dims));
  if (dims[1] > std::numeric_limits<int32_t>::max()) {
    return invalid("logits: expected at most 2^31 - 1 experts, got " + std::to_string(dims[1]));
  }
  return LogitsShape{dims[0], dims[1], *dtype};
}

// route: logits [T, E] (f32 / bf16 / f16), optionally bias [E] f32 (the handler's
// remaining operands: none means no selection bias; only sigmoid scoring uses it),
// weights [T, k] f32, expert_ids [T, k] s32.
inline ffi::ErrorOr<RouteParams> decode_route(ffi::AnyBuffer logits, ffi::RemainingArgs bias,
                                              ffi::Buffer<ffi::F32> weights, ffi::Buffer<ffi::S32> expert_ids,
                                              int64_t top_k, int64_t score, int64_t n_groups,
                                              int64_t topk_groups, bool renormalize, float scale) {
  auto shape = decode_logits(logits);
  if (shape.has_error()) return unexpected(shape.error());
  const auto [T, E, dtype] = *shape;
  if (top_k < 1 || top_k > E) {
    return invalid("top_k: expected 1 <= top_k <= " + std::to_string(E) + " (the number of experts), got " +
                   std::to_string(top_k));
  }
  if (score != static_cast<int64_t>(Score::kSoftmax) && score != static_cast<int64_t>(Score::kSigmoid)) {
    return invalid("score: expected 0 (softmax) or 1 (sigmoid), got " + std::to_string(score));
  }
  if (n_groups < 1 || E % n_groups != 0) {
    return invalid("n_groups: expected a positive divisor of the number of experts " + std::to_string(E) +
                   ", got " + std::to_string(n_groups));
  }
  if (n_groups == 1) {
    topk_groups = 1;  // no group limit: topk_groups is not used
  } else if (topk_groups < 1 || topk_groups > n_groups) {
    return invalid("topk_groups: expected 1 <= topk_groups <= n_groups = " + std::to_string(n_groups) +
                   ", got " + std::to_string(topk_groups));
  } else if (topk_groups * (E / n_groups) < top_k) {
    return invalid("topk_groups: expected topk_groups * (E / n_groups) >= top_k = " + std::to_string(top_k) +
                   ", got " + std::to_string(topk_groups) + " * " + std::to_string(E / n_groups));
  }
  auto b = optional_f32_operand(bias, "route", "logits", "bias", "[E]");
  if (b.has_error()) return unexpected(b.error());
  const float* bias_data = nullptr;
  if (b->has_value()) {
    if (auto e = expect_shape("bias", (*b)->dimensions(), {E}); e.failure()) return unexpected(e);
    bias_data = static_cast<const float*>((*b)->untyped_data());
  }
  if (auto e = expect_shape("weights", weights.dimensions(), {T, top_k}); e.failure()) return unexpected(e);
  if (auto e = expect_shape("expert_ids", expert_ids.dimensions(), {T, top_k}); e.failure()) {
    return unexpected(e);
  }
  RouteParams p{};
  p.logits = logits.untyped_data();
  p.logits_dtype = dtype;
  p.bias = bias_data;
  p.weights = weights.typed_data();
  p.expert_ids = expert_ids.typed_data();
  p.tokens = T;
  p.experts = E;
  p.top_k = top_k;
  p.score = static_cast<Score>(score);
  p.n_groups = n_groups;
  p.topk_groups = topk_groups;
  p.renormalize = renormalize;
  p.scale = scale;
  return p;
}

// route_grad: logits [T, E] (f32 / bf16 / f16), expert_ids [T, k] s32, d_weights [T, k]
// f32, d_logits [T, E] of logits' dtype.
inline ffi::ErrorOr<RouteGradParams> decode_route_grad(ffi::AnyBuffer logits, ffi::Buffer<ffi::S32> expert_ids,
                                                       ffi::Buffer<ffi::F32> d_weights, ffi::Result<ffi::AnyBuffer> d_logits,
                                                       int64_t score, bool renormalize, float scale) {
  auto shape = decode_logits(logits);
  if (shape.has_error()) return unexpected(shape.error());
  const auto [T, E, dtype] = *shape;
  const auto id_dims = expert_ids.dimensions();
  if (id_dims.size() != 2 || id_dims[0] != T || id_dims[1] < 1) {
    return invalid("expert_ids: expected shape [" + std::to_string(T) + ", k >= 1], got " + shape_string(id_dims));
  }
  const int64_t k = id_dims[1];
  if (score != static_cast<int64_t>(Score::kSoftmax) && score != static_cast<int64_t>(Score::kSigmoid)) {
    return invalid("score: expected 0 (softmax) or 1 (sigmoid), got " + std::to_string(score));
  }
  if (auto e = expect_shape("d_weights", d_weights.dimensions(), {T, k}); e.failure()) return unexpected(e);
  if (auto e = expect_shape("d_logits", d_logits->dimensions(), {T, E}); e.failure()) return unexpected(e);
  if (d_logits->element_type() != logits.element_type()) {
    return invalid("d_logits: expected the dtype of logits " + type_name(logits.element_type()) + ", got " +
                   type_name(d_logits->element_type()));
  }
  RouteGradParams p{};
  p.logits = logits.untyped_data();
  p.logits_dtype = dtype;
  p.expert_ids = expert_ids.typed_data();
  p.d_weights = d_weights.typed_data();
  p.d_logits = d_logits->untyped_data();
  p.tokens = T;
  p.experts = E;
  p.top_k = k;
  p.score = static_cast<Score>(score);
  p.renormalize = renormalize;
  p.scale = scale;
  return p;
}

// permute: x [T, H], expert_ids [T, k] s32, x_sorted [T*k, H] (dtype of x),
// group_sizes [E] s32, row_map [T*k] s32, row_pairs [T*k] s32.
inline ffi::ErrorOr<PermuteParams> decode_permute(ffi::AnyBuffer x, ffi::Buffer<ffi::S32> expert_ids,
                                                  ffi::AnyBuffer x_sorted, ffi::Buffer<ffi::S32> group_sizes,
                                                  ffi::Buffer<ffi::S32> row_map, ffi::Buffer<ffi::S32> row_pairs) {
  const auto x_dims = x.dimensions();
  if (x_dims.size() != 2) return invalid("x: expected rank 2 [T, H], got shape " + shape_string(x_dims));
  const int64_t T = x_dims[0], H = x_dims[1];
  auto dtype = to_dtype(x.element_type(), "x");
  if (dtype.has_error()) return unexpected(dtype.error());
  const auto id_dims = expert_ids.dimensions();
  if (id_dims.size() != 2 || id_dims[0] != T) {
    return invalid("expert_ids: expected shape [" + std::to_string(T) + ", k] (T from x), got " +
                   shape_string(id_dims));
  }
  const int64_t k = id_dims[1];
  if (T * k > std::numeric_limits<int32_t>::max()) {
    return invalid("expert_ids: T * k = " + std::to_string(T * k) + " does not fit the int32 row_map");
  }
  if (x_sorted.element_type() != x.element_type()) {
    return invalid("x_sorted: expected the dtype of x (" + type_name(x.element_type()) + "), got " +
                   type_name(x_sorted.element_type()));
  }
  if (auto e = expect_shape("x_sorted", x_sorted.dimensions(), {T * k, H}); e.failure()) return unexpected(e);
  if (group_sizes.dimensions().size() != 1) {
    return invalid("group_sizes: expected rank 1 [E], got shape " + shape_string(group_sizes.dimensions()));
  }
  const int64_t E = group_sizes.dimensions()[0];
  if (E > std::numeric_limits<int32_t>::max() - 1) {
    return invalid("group_sizes: expected fewer than 2^31 - 1 experts, got " + std::to_string(E));
  }
  if (auto e = expect_shape("row_map", row_map.dimensions(), {T * k}); e.failure()) return unexpected(e);
  if (auto e = expect_shape("row_pairs", row_pairs.dimensions(), {T * k}); e.failure()) return unexpected(e);
  PermuteParams p{};
  p.x = x.untyped_data();
  p.dtype = *dtype;
  p.expert_ids = expert_ids.typed_data();
  p.x_sorted = x_sorted.untyped_data();
  p.group_sizes = group_sizes.typed_data();
  p.row_map = row_map.typed_data();
  p.row_pairs = row_pairs.typed_data();
  p.tokens = T;
  p.hidden = H;
  p.top_k = k;
  p.experts = E;
  return p;
}

// unpermute: y_sorted [R, H], row_map [T*k] s32, optionally weights [T, k] f32 (the
// handler's remaining operands: none means every weight 1), y [T, H] (dtype of y_sorted).
inline ffi::ErrorOr<UnpermuteParams> decode_unpermute(ffi::AnyBuffer y_sorted, ffi::Buffer<ffi::S32> row_map,
                                                      ffi::RemainingArgs extra, ffi::AnyBuffer y) {
  const auto ys_dims = y_sorted.dimensions();
  if (ys_dims.size() != 2) return invalid("y_sorted: expected rank 2 [R, H], got shape " + shape_string(ys_dims));
  const int64_t H = ys_dims[1];
  auto dtype = to_dtype(y_sorted.element_type(), "y_sorted");
  if (dtype.has_error()) return unexpected(dtype.error());
  const auto y_dims = y.dimensions();
  if (y_dims.size() != 2) return invalid("y: expected rank 2 [T, H], got shape " + shape_string(y_dims));
  auto w = optional_f32_operand(extra, "unpermute", "row_map", "weights", "[T, k]");
  if (w.has_error()) return unexpected(w.error());
  const float* weights = nullptr;
  int64_t T = y_dims[0], k = 0;
  if (w->has_value()) {
    const auto w_dims = (*w)->dimensions();
    if (w_dims.size() != 2) return invalid("weights: expected rank 2 [T, k], got shape " + shape_string(w_dims));
    T = w_dims[0];
    k = w_dims[1];
    weights = static_cast<const float*>((*w)->untyped_data());
  } else if (T > 0) {
    const int64_t entries = static_cast<int64_t>(row_map.element_count());
    if (entries % T != 0) {
      return invalid("row_map: expected T*k entries, a multiple of y's T = " + std::to_string(T) + ", got " +
                     std::to_string(entries));
    }
    k = entries / T;
  }
  if (T * k > std::numeric_limits<int32_t>::max()) {
    return invalid("unpermute: T * k = " + std::to_string(T * k) + " does not fit the int32 row_map");
  }
  if (auto e = expect_shape("row_map", row_map.dimensions(), {T * k}); e.failure()) return unexpected(e);
  if (y.element_type() != y_sorted.element_type()) {
    return invalid("y: expected the dtype of y_sorted (" + type_name(y_sorted.element_type()) + "), got " +
                   type_name(y.element_type()));
  }
  if (auto e = expect_shape("y", y_dims, {T, H}); e.failure()) return unexpected(e);
  UnpermuteParams p{};
  p.y_sorted = y_sorted.untyped_data();
  p.dtype = *dtype;
  p.row_map = row_map.typed_data();
  p.weights = weights;
  p.y = y.untyped_data();
  p.tokens = T;
  p.hidden = H;
  p.top_k = k;
  p.rows = ys_dims[0];
  return p;
}

// The operands and attributes of the route handlers, appended to `binding` (the CPU and
// CUDA handlers bind the same list, the CUDA one after its stream), in the order of
// decode_route's parameters; the attribute names are those route.py's lowering passes.
template <class Binding>
auto bind_route(Binding&& binding) {
  return std::move(binding)
      .template Arg<ffi::AnyBuffer>()          // logits [T, E]
      .RemainingArgs()                         // bias [E], or none: no selection bias
      .template Ret<ffi::Buffer<ffi::F32>>()   // weights [T, k]
      .template Ret<ffi::Buffer<ffi::S32>>()   // expert_ids [T, k]
      .template Attr<int64_t>("top_k")
      .template Attr<int64_t>("score")         // 0 softmax, 1 sigmoid
      .template Attr<int64_t>("n_groups")
      .template Attr<int64_t>("topk_groups")
      .template Attr<bool>("renormalize")
      .template Attr<float>("scale");
}

template <typename Binding>
auto bind_route_grad(Binding&& binding) {
  return std::move(binding)
      .template Arg<ffi::AnyBuffer>()          // logits [T, E]
      .template Arg<ffi::Buffer<ffi::S32>>()   // expert_ids [T, k]
      .template Arg<ffi::Buffer<ffi::F32>>()   // d_weights [T, k]
      .template Ret<ffi::AnyBuffer>()          // d_logits [T, E]
      .template Attr<int64_t>("score")         // 0 softmax, 1 sigmoid
      .template Attr<bool>("renormalize")
      .template Attr<float>("scale");
}

}  // namespace moe_xla::ffi_args

#endif  // MOE_XLA_FFI_ROUTING_ARGS_H_
