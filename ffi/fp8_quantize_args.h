// Decodes and validates the buffers and attributes of the quantize_fp8_rows /
// quantize_fp8_blocks / quantize_fp8_weights FFI calls into the framework-free
// Fp8QuantizeParams of common/fp8_blockwise.h, those of quantize_fp8_group_cols,
// quantize_fp8_rows_group_cols, gather_quantize_fp8_group_cols and
// activate_quantize_fp8_group_cols into its Fp8GroupColsParams, those of
// activate_quantize_fp8 / activate_grad_quantize_fp8 into the Fp8ActivateQuantizeParams /
// Fp8ActivateGradQuantizeParams of common/expert_activation.h, and those of
// expand_quantize_fp8_rows into its Fp8ExpandQuantizeParams, for both the CPU and the CUDA
// handlers. Every error names the argument, what was expected and what was passed.
#ifndef MOE_XLA_FFI_FP8_QUANTIZE_ARGS_H_
#define MOE_XLA_FFI_FP8_QUANTIZE_ARGS_H_

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>
#include <tuple>
#include <utility>

#include "common/expert_activation.h"
#include "common/fp8_blockwise.h"
#include "ffi/activation_args.h"     // decode_activation_input, expect_dtype_of_h
#include "ffi/grouped_gemm_args.h"  // shape_string, type_name, to_dtype, invalid, expect_shape
#include "ffi/optional_operand.h"   // optional_f32_operand
#include "xla/ffi/api/ffi.h"

namespace moe_xla::ffi_args {

namespace ffi = xla::ffi;

// An FP8 result buffer: float8_e4m3fn, or an error naming it.
inline ffi::Error expect_fp8(const char* what, ffi::AnyBuffer buffer) {
  if (buffer.element_type() == ffi::DataType::F8E4M3FN) return ffi::Error::Success();
  return ffi::Error::InvalidArgument(std::string(what) + ": expected dtype float8_e4m3fn, got " +
                                     type_name(buffer.element_type()));
}

// x [M, K] (tile_rows 1: 1 x 128 row tiles) or [G, K, N] (tile_rows 128: 128 x 128
// blocks) of f32 / bf16 / f16; q float8_e4m3fn of x's shape; scales f32 of shape
// [M, ceil(K/128)] or [G, ceil(K/128), ceil(N/128)]; q_t, when given (blocks only: the
// weights' two layouts), float8_e4m3fn [G, N, K].
inline ffi::ErrorOr<Fp8QuantizeParams> decode_fp8_quantize(ffi::AnyBuffer x, ffi::AnyBuffer q,
                                                           ffi::Buffer<ffi::F32> scales, int64_t tile_rows,
                                                           bool pow2_scale, const ffi::AnyBuffer* q_t = nullptr) {
  const auto dims = x.dimensions();
  const char* name = tile_rows == 1 ? "x" : "w";  // the primitives' argument names
  Fp8QuantizeParams p{};
  if (tile_rows == 1) {
    if (dims.size() != 2) return invalid("x: expected rank 2 [M, K], got shape " + shape_string(dims));
    p.batch = 1;
    p.rows = dims[0];
    p.cols = dims[1];
    if (auto e = expect_shape("scales", scales.dimensions(), {p.rows, fp8::tiles(p.cols)}); e.failure()) {
      return ffi::Unexpected<ffi::Error>(std::move(e));
    }
  } else if (tile_rows == fp8::kTile) {
    if (dims.size() != 3) return invalid("w: expected rank 3 [G, K, N], got shape " + shape_string(dims));
    p.batch = dims[0];
    p.rows = dims[1];
    p.cols = dims[2];
    if (auto e = expect_shape("scales", scales.dimensions(), {p.batch, fp8::tiles(p.rows), fp8::tiles(p.cols)});
        e.failure()) {
      return ffi::Unexpected<ffi::Error>(std::move(e));
    }
  } else {
    return invalid("tile_rows: expected 1 or 128, got " + std::to_string(tile_rows));
  }
  auto dtype = to_dtype(x.element_type(), name);
  if (dtype.has_error()) return ffi::Unexpected<ffi::Error>(dtype.error());
  if (auto e = expect_fp8("q", q); e.failure()) return ffi::Unexpected<ffi::Error>(std::move(e));
  bool same_shape = q.dimensions().size() == dims.size();
  for (size_t i = 0; same_shape && i < dims.size(); ++i) same_shape = q.dimensions()[i] == dims[i];
  if (!same_shape) {
    return invalid(std::string("q: expected the shape of ") + name + " " + shape_string(dims) + ", got " +
                   shape_string(q.dimensions()));
  }
  p.x = x.untyped_data();
  p.dtype = *dtype;
  p.q = static_cast<uint8_t*>(q.untyped_data());
  if (q_t != nullptr) {
    if (tile_rows != fp8::kTile) {
      return invalid("q_t: expected only with 128 x 128 blocks (tile_rows 128), got tile_rows " +
                     std::to_string(tile_rows));
    }
    for (auto e : {expect_fp8("q_t", *q_t), expect_shape("q_t", q_t->dimensions(), {p.batch, p.cols, p.rows})}) {
      if (e.failure()) return ffi::Unexpected<ffi::Error>(std::move(e));
    }
    p.q_t = static_cast<uint8_t*>(q_t->untyped_data());
  }
  p.scales = scales.typed_data();
  p.tile_rows = tile_rows;
  p.pow2_scale = pow2_scale;
  return p;
}

// The column tiles' buffers of p.rows x p.cols rows, into p: group_sizes [G] int32, q_t
// [K, 128 T] float8_e4m3fn and scales [T, K] f32, T = group_col_tiles(M, G).
inline ffi::Error set_group_col_buffers(Fp8GroupColsParams& p, ffi::Buffer<ffi::S32> group_sizes, ffi::AnyBuffer q_t,
                                        ffi::Buffer<ffi::F32> scales, bool pow2_scale) {
  if (group_sizes.dimensions().size() != 1) {
    return ffi::Error::InvalidArgument("group_sizes: expected rank 1 [G], got shape " +
                                       shape_string(group_sizes.dimensions()));
  }
  p.num_groups = group_sizes.dimensions()[0];
  const int64_t tiles = group_col_tiles(p.rows, p.num_groups);
  for (auto e : {expect_fp8("q_t", q_t), expect_shape("q_t", q_t.dimensions(), {p.cols, fp8::kTile * tiles}),
                 expect_shape("scales", scales.dimensions(), {tiles, p.cols})}) {
    if (e.failure()) return e;
  }
  p.group_sizes = group_sizes.typed_data();
  p.q_t = static_cast<uint8_t*>(q_t.untyped_data());
  p.scales = scales.typed_data();
  p.pow2_scale = pow2_scale;
  return ffi::Error::Success();
}

// The row tiles' buffers of p.rows x p.cols rows, into p: q [M, K] float8_e4m3fn and
// row_scales [M, ceil(K/128)] f32.
inline ffi::Error set_row_tile_buffers(Fp8GroupColsParams& p, ffi::AnyBuffer q, ffi::Buffer<ffi::F32> row_scales) {
  for (auto e : {expect_fp8("q", q), expect_shape("q", q.dimensions(), {p.rows, p.cols}),
                 expect_shape("row_scales", row_scales.dimensions(), {p.rows, fp8::tiles(p.cols)})}) {
    if (e.failure()) return e;
  }
  p.q = static_cast<uint8_t*>(q.untyped_data());
  p.row_scales = row_scales.typed_data();
  return ffi::Error::Success();
}

// x [M, K] of f32 / bf16 / f16; group_sizes [G] int32; q_t [K, 128 T] float8_e4m3fn and
// scales [T, K] f32, T = group_col_tiles(M, G).
inline ffi::ErrorOr<Fp8GroupColsParams> decode_fp8_group_cols(ffi::AnyBuffer x, ffi::Buffer<ffi::S32> group_sizes,
                                                              ffi::AnyBuffer q_t, ffi::Buffer<ffi::F32> scales,
                                                              bool pow2_scale) {
  const auto dims = x.dimensions();
  if (dims.size() != 2) return invalid("x: expected rank 2 [M, K], got shape " + shape_string(dims));
  auto dtype = to_dtype(x.element_type(), "x");
  if (dtype.has_error()) return ffi::Unexpected<ffi::Error>(dtype.error());
  Fp8GroupColsParams p{};
  p.x = x.untyped_data();
  p.dtype = *dtype;
  p.rows = dims[0];
  p.cols = dims[1];
  if (auto e = set_group_col_buffers(p, group_sizes, q_t, scales, pow2_scale); e.failure()) {
    return ffi::Unexpected<ffi::Error>(std::move(e));
  }
  return p;
}

// decode_fp8_group_cols with x's row tiles too: q [M, K] float8_e4m3fn and row_scales
// [M, ceil(K/128)] f32.
inline ffi::ErrorOr<Fp8GroupColsParams> decode_fp8_rows_group_cols(ffi::AnyBuffer x, ffi::Buffer<ffi::S32> group_sizes,
                                                                   ffi::AnyBuffer q, ffi::Buffer<ffi::F32> row_scales,
                                                                   ffi::AnyBuffer q_t, ffi::Buffer<ffi::F32> scales,
                                                                   bool pow2_scale) {
  auto p = decode_fp8_group_cols(x, group_sizes, q_t, scales, pow2_scale);
  if (p.has_error()) return p;
  if (auto e = set_row_tile_buffers(*p, q, row_scales); e.failure()) return ffi::Unexpected<ffi::Error>(std::move(e));
  return p;
}

// Both tilings of rows gathered from token rows (Fp8GroupColsParams, kGathered): values
// [T, K] of f32 / bf16 / f16 (T < 2^31); sources [M] int32 (M < 2^31); group_sizes [G]
// int32; optionally factor [M] f32 (the handler's remaining operands: none means v = u,
// p.factor null); q [M, K] float8_e4m3fn; row_scales [M, ceil(K/128)] f32; q_t [K, 128 T']
// float8_e4m3fn and scales [T', K] f32, T' = group_col_tiles(M, G).
inline ffi::ErrorOr<Fp8GroupColsParams> decode_fp8_gather_group_cols(
    ffi::AnyBuffer values, ffi::AnyBuffer sources, ffi::Buffer<ffi::S32> group_sizes, ffi::RemainingArgs rest,
    ffi::AnyBuffer q, ffi::Buffer<ffi::F32> row_scales, ffi::AnyBuffer q_t, ffi::Buffer<ffi::F32> scales,
    bool pow2_scale) {
  const auto dims = values.dimensions();
  if (dims.size() != 2) return invalid("values: expected rank 2 [T, K], got shape " + shape_string(dims));
  if (sources.dimensions().size() != 1) {
    return invalid("sources: expected rank 1 [M], got shape " + shape_string(sources.dimensions()));
  }
  auto dtype = to_dtype(values.element_type(), "values");
  if (dtype.has_error()) return ffi::Unexpected<ffi::Error>(dtype.error());
  if (sources.element_type() != ffi::DataType::S32) {
    return invalid("sources: expected dtype int32, got " + type_name(sources.element_type()));
  }
  auto factor = optional_f32_operand(rest, "gather_quantize_fp8_group_cols", "group_sizes", "factor", "[M]");
  if (factor.has_error()) return ffi::Unexpected<ffi::Error>(factor.error());
  Fp8GroupColsParams p{};
  p.values_rows = dims[0];
  p.rows = sources.dimensions()[0];
  p.cols = dims[1];
  if (p.values_rows > INT32_MAX) return invalid("values: expected fewer than 2^31 rows, got " + shape_string(dims));
  if (p.rows > INT32_MAX) {
    return invalid("sources: expected fewer than 2^31 rows, got " + shape_string(sources.dimensions()));
  }
  if (factor->has_value()) {
    if (auto e = expect_shape("factor", (*factor)->dimensions(), {p.rows}); e.failure()) {
      return ffi::Unexpected<ffi::Error>(std::move(e));
    }
    p.factor = static_cast<const float*>((*factor)->untyped_data());
  }
  for (auto e : {set_row_tile_buffers(p, q, row_scales),
                 set_group_col_buffers(p, group_sizes, q_t, scales, pow2_scale)}) {
    if (e.failure()) return ffi::Unexpected<ffi::Error>(std::move(e));
  }
  p.x = values.untyped_data();
  p.dtype = *dtype;
  p.source = GroupColsRows::kGathered;
  p.sources = static_cast<const int32_t*>(sources.untyped_data());
  return p;
}

// Both tilings of the expert activation of h (Fp8GroupColsParams, kActivated): h
// [M, 2F] (gated) or [M, F] of f32 / bf16 / f16; group_sizes [G] int32; q [M, F]
// float8_e4m3fn; row_scales [M, ceil(F/128)] f32; q_t [F, 128 T] float8_e4m3fn and scales
// [T, F] f32, T = group_col_tiles(M, G).
inline ffi::ErrorOr<Fp8GroupColsParams> decode_fp8_activate_group_cols(
    ffi::AnyBuffer h, ffi::Buffer<ffi::S32> group_sizes, ffi::AnyBuffer q, ffi::Buffer<ffi::F32> row_scales,
    ffi::AnyBuffer q_t, ffi::Buffer<ffi::F32> scales, int32_t activation, bool pow2_scale) {
  auto in = decode_activation_input(h, activation);
  if (in.has_error()) return ffi::Unexpected<ffi::Error>(in.error());
  Fp8GroupColsParams p{};
  p.source = GroupColsRows::kActivated;
  p.activation = in->activation;
  p.rows = in->rows;
  p.cols = is_gated(p.activation) ? in->h_cols / 2 : in->h_cols;
  for (auto e : {set_row_tile_buffers(p, q, row_scales),
                 set_group_col_buffers(p, group_sizes, q_t, scales, pow2_scale)}) {
    if (e.failure()) return ffi::Unexpected<ffi::Error>(std::move(e));
  }
  p.x = h.untyped_data();
  p.dtype = in->dtype;
  return p;
}

// The buffers of the activation's backward beside h [M, 2F] or [M, F] (decoded; F given):
// g [M, F] of h's dtype, omega [M] f32 and d_omega_tiles [M, ceil(F/128)] f32; the error
// naming the first that does not fit.
inline ffi::Error expect_activation_grad_buffers(ffi::AnyBuffer h, ffi::AnyBuffer g, ffi::Buffer<ffi::F32> omega,
                                                 ffi::Buffer<ffi::F32> d_omega_tiles, int64_t f) {
  const int64_t rows = h.dimensions()[0];
  for (auto e : {expect_dtype_of_h(h, {{"g", g}}), expect_shape("g", g.dimensions(), {rows, f}),
                 expect_shape("omega", omega.dimensions(), {rows}),
                 expect_shape("d_omega_tiles", d_omega_tiles.dimensions(), {rows, fp8::tiles(f)})}) {
    if (e.failure()) return e;
  }
  return ffi::Error::Success();
}

// h [M, 2F] (gated) or [M, F]; a [M, F] of h's dtype; q [M, F] float8_e4m3fn; scales
// [M, ceil(F/128)] f32.
inline ffi::ErrorOr<Fp8ActivateQuantizeParams> decode_fp8_activate_quantize(ffi::AnyBuffer h, ffi::AnyBuffer a,
                                                                            ffi::AnyBuffer q,
                                                                            ffi::Buffer<ffi::F32> scales,
                                                                            int32_t activation, bool pow2_scale) {
  auto in = decode_activation_input(h, activation);
  if (in.has_error()) return ffi::Unexpected<ffi::Error>(in.error());
  Fp8ActivateQuantizeParams p{};
  p.activation = in->activation;
  p.rows = in->rows;
  p.cols = is_gated(p.activation) ? in->h_cols / 2 : in->h_cols;
  if (auto e = expect_dtype_of_h(h, {{"a", a}}); e.failure()) return ffi::Unexpected<ffi::Error>(std::move(e));
  if (auto e = expect_fp8("q", q); e.failure()) return ffi::Unexpected<ffi::Error>(std::move(e));
  for (auto [name, got] : {std::pair{"a", a.dimensions()}, std::pair{"q", q.dimensions()}}) {
    if (auto e = expect_shape(name, got, {p.rows, p.cols}); e.failure()) {
      return ffi::Unexpected<ffi::Error>(std::move(e));
    }
  }
  if (auto e = expect_shape("scales", scales.dimensions(), {p.rows, fp8::tiles(p.cols)}); e.failure()) {
    return ffi::Unexpected<ffi::Error>(std::move(e));
  }
  p.h = h.untyped_data();
  p.dtype = in->dtype;
  p.a = a.untyped_data();
  p.q = static_cast<uint8_t*>(q.untyped_data());
  p.scales = scales.typed_data();
  p.pow2_scale = pow2_scale;
  return p;
}

// h [M, 2F] (gated) or [M, F]; g [M, F] and dh [M, C] (C: h's last dim) of h's dtype;
// omega [M] f32; q [M, C] float8_e4m3fn; scales [M, ceil(C/128)] f32; d_omega_tiles
// [M, ceil(F/128)] f32.
inline ffi::ErrorOr<Fp8ActivateGradQuantizeParams> decode_fp8_activate_grad_quantize(
    ffi::AnyBuffer h, ffi::AnyBuffer g, ffi::Buffer<ffi::F32> omega, ffi::AnyBuffer dh, ffi::AnyBuffer q,
    ffi::Buffer<ffi::F32> scales, ffi::Buffer<ffi::F32> d_omega_tiles, int32_t activation, bool pow2_scale) {
  auto in = decode_activation_input(h, activation);
  if (in.has_error()) return ffi::Unexpected<ffi::Error>(in.error());
  Fp8ActivateGradQuantizeParams p{};
  p.activation = in->activation;
  p.rows = in->rows;
  p.cols = in->h_cols;
  const int64_t f = is_gated(p.activation) ? p.cols / 2 : p.cols;
  for (auto e : {expect_activation_grad_buffers(h, g, omega, d_omega_tiles, f), expect_dtype_of_h(h, {{"dh", dh}}),
                 expect_fp8("q", q), expect_shape("dh", dh.dimensions(), {p.rows, p.cols}),
                 expect_shape("q", q.dimensions(), {p.rows, p.cols}),
                 expect_shape("scales", scales.dimensions(), {p.rows, fp8::tiles(p.cols)})}) {
    if (e.failure()) return ffi::Unexpected<ffi::Error>(std::move(e));
  }
  p.h = h.untyped_data();
  p.g = g.untyped_data();
  p.omega = omega.typed_data();
  p.dtype = in->dtype;
  p.dh = dh.untyped_data();
  p.q = static_cast<uint8_t*>(q.untyped_data());
  p.scales = scales.typed_data();
  p.d_omega_tiles = d_omega_tiles.typed_data();
  p.pow2_scale = pow2_scale;
  return p;
}

// values [T, H] of f32 / bf16 / f16; slots [T, k] int32; optionally factor [T, k] f32 (the
// handler's remaining operands: none means every factor 1, p.factor null); rows [R, H] of
// values' dtype; q [R, H] float8_e4m3fn; scales [R, ceil(H/128)] f32.
inline ffi::ErrorOr<Fp8ExpandQuantizeParams> decode_fp8_expand_quantize(ffi::AnyBuffer values, ffi::AnyBuffer slots,
                                                                       ffi::RemainingArgs rest, ffi::AnyBuffer rows,
                                                                       ffi::AnyBuffer q, ffi::Buffer<ffi::F32> scales,
                                                                       bool pow2_scale) {
  const auto dims = values.dimensions();
  if (dims.size() != 2) return invalid("values: expected rank 2 [T, H], got shape " + shape_string(dims));
  if (slots.dimensions().size() != 2) {
    return invalid("slots: expected rank 2 [T, k], got shape " + shape_string(slots.dimensions()));
  }
  if (rows.dimensions().size() != 2) {
    return invalid("rows: expected rank 2 [R, H], got shape " + shape_string(rows.dimensions()));
  }
  auto dtype = to_dtype(values.element_type(), "values");
  if (dtype.has_error()) return ffi::Unexpected<ffi::Error>(dtype.error());
  for (auto [name, buffer, want] : {std::tuple{"slots", slots, ffi::DataType::S32},
                                    std::tuple{"rows", rows, values.element_type()}}) {
    if (buffer.element_type() != want) {
      return invalid(std::string(name) + ": expected dtype " + type_name(want) + ", got " +
                     type_name(buffer.element_type()));
    }
  }
  auto factor = optional_f32_operand(rest, "expand_quantize_fp8_rows", "slots", "factor", "[T, k]");
  if (factor.has_error()) return ffi::Unexpected<ffi::Error>(factor.error());
  Fp8ExpandQuantizeParams p{};
  p.num_values = dims[0];
  p.top_k = slots.dimensions()[1];
  p.rows = rows.dimensions()[0];
  p.cols = dims[1];
  if (p.num_values > INT32_MAX) return invalid("values: expected fewer than 2^31 rows, got " + shape_string(dims));
  for (auto e : {expect_shape("slots", slots.dimensions(), {p.num_values, p.top_k}), expect_fp8("q", q),
                 expect_shape("rows", rows.dimensions(), {p.rows, p.cols}),
                 expect_shape("q", q.dimensions(), {p.rows, p.cols}),
                 expect_shape("scales", scales.dimensions(), {p.rows, fp8::tiles(p.cols)})}) {
    if (e.failure()) return ffi::Unexpected<ffi::Error>(std::move(e));
  }
  if (factor->has_value()) {
    if (auto e = expect_shape("factor", (*factor)->dimensions(), {p.num_values, p.top_k}); e.failure()) {
      return ffi::Unexpected<ffi::Error>(std::move(e));
    }
    p.factor = static_cast<const float*>((*factor)->untyped_data());
  }
  p.values = values.untyped_data();
  p.dtype = *dtype;
  p.slots = static_cast<const int32_t*>(slots.untyped_data());
  p.out = rows.untyped_data();
  p.q = static_cast<uint8_t*>(q.untyped_data());
  p.scales = scales.typed_data();
  p.pow2_scale = pow2_scale;
  return p;
}

// The operands and attributes of the activate_grad_quantize_fp8 handlers, appended to
// `binding`.
template <class Binding>
auto bind_fp8_activate_grad_quantize(Binding&& binding) {
  return std::move(binding)
      .template Arg<ffi::AnyBuffer>()          // h [M, 2F] or [M, F]
      .template Arg<ffi::AnyBuffer>()          // g [M, F], dtype of h
      .template Arg<ffi::Buffer<ffi::F32>>()   // omega [M]
      .template Ret<ffi::AnyBuffer>()          // dh, shape and dtype of h
      .template Ret<ffi::AnyBuffer>()          // q, shape of h, float8_e4m3fn
      .template Ret<ffi::Buffer<ffi::F32>>()   // scales [M, ceil(C/128)]
      .template Ret<ffi::Buffer<ffi::F32>>()   // d_omega_tiles [M, ceil(F/128)]
      .template Attr<int32_t>("activation")
      .template Attr<bool>("pow2_scale");
}

// The operands and attributes of the expand_quantize_fp8_rows handlers, appended to `binding`.
template <class Binding>
auto bind_fp8_expand_quantize(Binding&& binding) {
  return std::move(binding)
      .template Arg<ffi::AnyBuffer>()          // values [T, H]
      .template Arg<ffi::AnyBuffer>()          // slots [T, k], int32
      .template RemainingArgs()                // factor [T, k], float32, or none: every factor 1
      .template Ret<ffi::AnyBuffer>()          // rows [R, H], dtype of values
      .template Ret<ffi::AnyBuffer>()          // q [R, H], float8_e4m3fn
      .template Ret<ffi::Buffer<ffi::F32>>();  // scales [R, ceil(H/128)]
}

// The results of the handlers that write both tilings of one operand [M, K] (row tiles and
// group column tiles), appended to `binding`.
template <class Binding>
auto with_both_tilings(Binding&& binding) {
  return std::move(binding)
      .template Ret<ffi::AnyBuffer>()          // q [M, K], float8_e4m3fn
      .template Ret<ffi::Buffer<ffi::F32>>()   // row_scales [M, ceil(K/128)]
      .template Ret<ffi::AnyBuffer>()          // q_t [K, 128 T], float8_e4m3fn
      .template Ret<ffi::Buffer<ffi::F32>>();  // scales [T, K]
}

// The operands and attributes of the gather_quantize_fp8_group_cols handlers, appended to
// `binding`.
template <class Binding>
auto bind_fp8_gather_group_cols(Binding&& binding) {
  return with_both_tilings(std::move(binding)
                               .template Arg<ffi::AnyBuffer>()         // values [T, K]
                               .template Arg<ffi::AnyBuffer>()         // sources [M], int32
                               .template Arg<ffi::Buffer<ffi::S32>>()  // group_sizes [G]
                               .template RemainingArgs())              // factor [M], float32, or none: v = u
      .template Attr<bool>("pow2_scale");
}

// The operands and attributes of the activate_quantize_fp8_group_cols handlers, appended to
// `binding`.
template <class Binding>
auto bind_fp8_activate_group_cols(Binding&& binding) {
  return with_both_tilings(std::move(binding)
                               .template Arg<ffi::AnyBuffer>()          // h [M, 2F] or [M, F]; K = F
                               .template Arg<ffi::Buffer<ffi::S32>>())  // group_sizes [G]
      .template Attr<int32_t>("activation")
      .template Attr<bool>("pow2_scale");
}

// The operands and attributes of the activate_quantize_fp8 handlers, appended to `binding`.
template <class Binding>
auto bind_fp8_activate_quantize(Binding&& binding) {
  return std::move(binding)
      .template Arg<ffi::AnyBuffer>()          // h [M, 2F] or [M, F]
      .template Ret<ffi::AnyBuffer>()          // a [M, F], dtype of h
      .template Ret<ffi::AnyBuffer>()          // q [M, F], float8_e4m3fn
      .template Ret<ffi::Buffer<ffi::F32>>()   // scales [M, ceil(F/128)]
      .template Attr<int32_t>("activation")
      .template Attr<bool>("pow2_scale");
}

// The operands and attributes of the quantize_fp8_group_cols handlers, appended to `binding`.
template <class Binding>
auto bind_fp8_group_cols(Binding&& binding) {
  return std::move(binding)
      .template Arg<ffi::AnyBuffer>()          // x [M, K]
      .template Arg<ffi::Buffer<ffi::S32>>()   // group_sizes [G]
      .template Ret<ffi::AnyBuffer>()          // q_t [K, 128 T], float8_e4m3fn
      .template Ret<ffi::Buffer<ffi::F32>>()   // scales [T, K]
      .template Attr<bool>("pow2_scale");
}

// The operands and attributes of the quantize_fp8_rows_group_cols handlers, appended to `binding`.
template <class Binding>
auto bind_fp8_rows_group_cols(Binding&& binding) {
  return with_both_tilings(std::move(binding)
                               .template Arg<ffi::AnyBuffer>()          // x [M, K]
                               .template Arg<ffi::Buffer<ffi::S32>>())  // group_sizes [G]
      .template Attr<bool>("pow2_scale");
}

// The operands and attributes of the quantisation handlers, appended to `binding` (the
// CUDA handlers bind them after their stream); the attribute name is the one the
// primitives' lowerings pass. The tile shape is fixed per handler, not an attribute.
template <class Binding>
auto bind_fp8_quantize(Binding&& binding) {
  return std::move(binding)
      .template Arg<ffi::AnyBuffer>()          // x [M, K] or w [G, K, N]
      .template Ret<ffi::AnyBuffer>()          // q, float8_e4m3fn, shape of x
      .template Ret<ffi::Buffer<ffi::F32>>()   // scales, one per tile
      .template Attr<bool>("pow2_scale");
}

// The operands and attributes of the quantize_fp8_weights handlers (the blocks in both
// layouts), appended to `binding`.
template <class Binding>
auto bind_fp8_weight_layouts(Binding&& binding) {
  return std::move(binding)
      .template Arg<ffi::AnyBuffer>()          // w [G, K, N]
      .template Ret<ffi::AnyBuffer>()          // q [G, K, N], float8_e4m3fn
      .template Ret<ffi::AnyBuffer>()          // q_t [G, N, K], float8_e4m3fn: q transposed
      .template Ret<ffi::Buffer<ffi::F32>>()   // scales [G, ceil(K/128), ceil(N/128)]
      .template Attr<bool>("pow2_scale");
}

}  // namespace moe_xla::ffi_args

#endif  // MOE_XLA_FFI_FP8_QUANTIZE_ARGS_H_
