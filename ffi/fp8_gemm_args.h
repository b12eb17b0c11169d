// Decodes and validates the buffers of the gmm_fp8 FFI calls into the framework-free
// Fp8GroupedGemmParams of common/fp8_grouped_gemm.h, for both the CPU and the CUDA
// handlers. Every error names the argument, what was expected and what was passed.
#ifndef MOE_XLA_FFI_FP8_GEMM_ARGS_H_
#define MOE_XLA_FFI_FP8_GEMM_ARGS_H_

#include <cstdint>
#include <string>
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
  if (out.element_type() == ffi::DataType::BF16) {
    p.out_dtype = DType::kBF16;
  } else if (out.element_type() == ffi::DataType::F32) {
    p.out_dtype = DType::kF32;
  } else {
    return invalid("out: expected dtype bfloat16 or float32, got " + type_name(out.element_type()));
  }
  p.lhs = static_cast<const uint8_t*>(lhs.untyped_data());
  p.lhs_scales = lhs_scales.typed_data();
  p.rhs = static_cast<const uint8_t*>(rhs.untyped_data());
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

}  // namespace moe_xla::ffi_args

#endif  // MOE_XLA_FFI_FP8_GEMM_ARGS_H_
