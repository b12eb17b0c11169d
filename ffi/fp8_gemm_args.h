// Decodes and validates the buffers of the gmm_fp8 FFI calls into the framework-free
// Fp8GroupedGemmParams of common/fp8_grouped_gemm.h, and those of tgmm_fp8 into its
// Fp8WgradParams, for both the CPU and the CUDA handlers. Every error names the argument,
// what was expected and what was passed.
#ifndef MOE_XLA_FFI_FP8_GEMM_ARGS_H_
#define MOE_XLA_FFI_FP8_GEMM_ARGS_H_

#include <cstdint>
#include <string>
#include <tuple>
#include <utility>

#include "common/fp8_grouped_gemm.h"
#include "ffi/grouped_gemm_args.h"  // shape_string, type_name, invalid, expect_shape
#include "xla/ffi/api/ffi.h"

namespace moe_xla::ffi_args {

namespace ffi = xla::ffi;

inline ffi::Error expect_fp8(const char* what, ffi::AnyBuffer b) {
  if (b.element_type() == ffi::DataType::F8E4M3FN) return ffi::Error::Success();
  return ffi::Error::InvalidArgument(std::string(what) + ": expected dtype float8_e4m3fn, got " +
                                     type_name(b.element_type()));
}

// The output dtype of the FP8 products: bfloat16 or float32.
inline ffi::ErrorOr<DType> fp8_out_dtype(ffi::AnyBuffer out) {
  if (out.element_type() == ffi::DataType::BF16) return DType::kBF16;
  if (out.element_type() == ffi::DataType::F32) return DType::kF32;
  return invalid("out: expected dtype bfloat16 or float32, got " + type_name(out.element_type()));
}

// lhs [M, K] f8, lhs_scales [M, Kt] f32, rhs [G, N, K] f8, rhs_scales [G, Kt, Nt] f32,
// group_sizes [G] int32, out [M, N] bf16 / f32.
inline ffi::ErrorOr<Fp8GroupedGemmParams> decode_fp8_gemm(ffi::AnyBuffer lhs, ffi::Buffer<ffi::F32> lhs_scales,
                                                          ffi::AnyBuffer rhs, ffi::Buffer<ffi::F32> rhs_scales,
                                                          ffi::Buffer<ffi::S32> group_sizes, ffi::AnyBuffer out) {
  if (lhs.dimensions().size() != 2) return invalid("lhs: expected rank 2 [M, K], got shape " + shape_string(lhs.dimensions()));
  if (group_sizes.dimensions().size() != 1) {
    return invalid("group_sizes: expected rank 1, got shape " + shape_string(group_sizes.dimensions()));
  }
  Fp8GroupedGemmParams p{};
  p.m = lhs.dimensions()[0];
  p.k = lhs.dimensions()[1];
  p.num_groups = group_sizes.dimensions()[0];
  const auto rhs_dims = rhs.dimensions();
  if (rhs_dims.size() != 3 || rhs_dims[0] != p.num_groups || rhs_dims[2] != p.k) {
    return invalid("rhs: expected shape [" + std::to_string(p.num_groups) + ", N, " + std::to_string(p.k) + "], got " +
                   shape_string(rhs_dims));
  }
  p.n = rhs_dims[1];
  const int64_t kt = fp8::tiles(p.k), nt = fp8::tiles(p.n);
  for (auto e : {expect_fp8("lhs", lhs), expect_fp8("rhs", rhs),
                 expect_shape("lhs_scales", lhs_scales.dimensions(), {p.m, kt}),
                 expect_shape("rhs_scales", rhs_scales.dimensions(), {p.num_groups, kt, nt}),
                 expect_shape("out", out.dimensions(), {p.m, p.n})}) {
    if (e.failure()) return ffi::Unexpected<ffi::Error>(std::move(e));
  }
  auto out_dtype = fp8_out_dtype(out);
  if (out_dtype.has_error()) return ffi::Unexpected<ffi::Error>(out_dtype.error());
  p.out_dtype = *out_dtype;
  p.lhs = static_cast<const uint8_t*>(lhs.untyped_data());
  p.lhs_scales = lhs_scales.typed_data();
  p.rhs = static_cast<const uint8_t*>(rhs.untyped_data());
  p.rhs_scales = rhs_scales.typed_data();
  p.group_sizes = group_sizes.typed_data();
  p.out = out.untyped_data();
  return p;
}

// lhs_t [K, 128 T] f8, lhs_scales [T, K] f32, rhs_t [N, 128 T] f8, rhs_scales [T, N] f32,
// group_sizes [G] int32, out [G, K, N] bf16 / f32; T = group_col_tiles(rows, G), the tiles
// quantize_fp8_group_cols cut `rows` rows into.
inline ffi::ErrorOr<Fp8WgradParams> decode_fp8_wgrad(ffi::AnyBuffer lhs_t, ffi::Buffer<ffi::F32> lhs_scales,
                                                     ffi::AnyBuffer rhs_t, ffi::Buffer<ffi::F32> rhs_scales,
                                                     ffi::Buffer<ffi::S32> group_sizes, ffi::AnyBuffer out,
                                                     int64_t rows) {
  if (rows < 0) return invalid("rows: expected M >= 0, got " + std::to_string(rows));
  if (group_sizes.dimensions().size() != 1) {
    return invalid("group_sizes: expected rank 1 [G], got shape " + shape_string(group_sizes.dimensions()));
  }
  Fp8WgradParams p{};
  p.m = rows;
  p.num_groups = group_sizes.dimensions()[0];
  const int64_t tiles = group_col_tiles(rows, p.num_groups);
  const std::string width = std::to_string(fp8::kTile * tiles);
  for (auto [name, b, dim] : {std::tuple{"lhs_t", lhs_t, "K"}, std::tuple{"rhs_t", rhs_t, "N"}}) {
    const auto dims = b.dimensions();
    if (dims.size() != 2 || dims[1] != fp8::kTile * tiles) {
      return invalid(std::string(name) + ": expected shape [" + dim + ", " + width +
                     "] (128 T, T = ceil(rows / 128) + G = " + std::to_string(tiles) + " for rows " +
                     std::to_string(rows) + ", G " + std::to_string(p.num_groups) + "), got " + shape_string(dims));
    }
    if (auto e = expect_fp8(name, b); e.failure()) return ffi::Unexpected<ffi::Error>(std::move(e));
  }
  p.k = lhs_t.dimensions()[0];
  p.n = rhs_t.dimensions()[0];
  for (auto e : {expect_shape("lhs_scales", lhs_scales.dimensions(), {tiles, p.k}),
                 expect_shape("rhs_scales", rhs_scales.dimensions(), {tiles, p.n}),
                 expect_shape("out", out.dimensions(), {p.num_groups, p.k, p.n})}) {
    if (e.failure()) return ffi::Unexpected<ffi::Error>(std::move(e));
  }
  auto out_dtype = fp8_out_dtype(out);
  if (out_dtype.has_error()) return ffi::Unexpected<ffi::Error>(out_dtype.error());
  p.out_dtype = *out_dtype;
  p.lhs_t = static_cast<const uint8_t*>(lhs_t.untyped_data());
  p.lhs_scales = lhs_scales.typed_data();
  p.rhs_t = static_cast<const uint8_t*>(rhs_t.untyped_data());
  p.rhs_scales = rhs_scales.typed_data();
  p.group_sizes = group_sizes.typed_data();
  p.out = out.untyped_data();
  return p;
}

// The operands of the gmm_fp8 handlers, appended to `binding` (the CUDA handler binds its
// stream first and its workspace result last).
template <class Binding>
auto bind_fp8_gemm(Binding&& binding) {
  return std::move(binding)
      .template Arg<ffi::AnyBuffer>()           // lhs [M, K] float8_e4m3fn
      .template Arg<ffi::Buffer<ffi::F32>>()    // lhs_scales [M, Kt]
      .template Arg<ffi::AnyBuffer>()           // rhs [G, N, K] float8_e4m3fn
      .template Arg<ffi::Buffer<ffi::F32>>()    // rhs_scales [G, Kt, Nt]
      .template Arg<ffi::Buffer<ffi::S32>>()    // group_sizes [G]
      .template Ret<ffi::AnyBuffer>()           // out [M, N] bf16 / f32
      .template Attr<int32_t>("path");          // cuda::Fp8GemmPath (ignored on the CPU: one kernel)
}

// The operands and attributes of the tgmm_fp8 handlers, appended to `binding` (the CUDA
// handler binds its stream first and its workspace result last).
template <class Binding>
auto bind_fp8_wgrad(Binding&& binding) {
  return std::move(binding)
      .template Arg<ffi::AnyBuffer>()           // lhs_t [K, 128 T] float8_e4m3fn
      .template Arg<ffi::Buffer<ffi::F32>>()    // lhs_scales [T, K]
      .template Arg<ffi::AnyBuffer>()           // rhs_t [N, 128 T] float8_e4m3fn
      .template Arg<ffi::Buffer<ffi::F32>>()    // rhs_scales [T, N]
      .template Arg<ffi::Buffer<ffi::S32>>()    // group_sizes [G]
      .template Ret<ffi::AnyBuffer>()           // out [G, K, N] bf16 / f32
      .template Attr<int64_t>("rows")           // M, the rows both operands were quantised from
      .template Attr<int32_t>("path");          // cuda::Fp8WgradPath (ignored on the CPU: one kernel)
}

}  // namespace moe_xla::ffi_args

#endif  // MOE_XLA_FFI_FP8_GEMM_ARGS_H_
