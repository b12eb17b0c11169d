// Decodes and validates the buffers of the gmm / tgmm FFI calls into the framework-free
// GroupedGemmParams, for both the CPU and the CUDA handlers.
#ifndef MOE_XLA_FFI_GROUPED_GEMM_ARGS_H_
#define MOE_XLA_FFI_GROUPED_GEMM_ARGS_H_

#include <cstdint>
#include <string>

#include "common/grouped_gemm.h"
#include "xla/ffi/api/ffi.h"

namespace moe_xla::ffi_args {

namespace ffi = xla::ffi;

inline std::string shape_string(ffi::AnyBuffer::Dimensions dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + "]";
}

inline ffi::Unexpected<ffi::Error> invalid(std::string message) {
  return ffi::Unexpected<ffi::Error>(ffi::Error::InvalidArgument(std::move(message)));
}

inline std::string type_name(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F32: return "float32";
    case ffi::DataType::BF16: return "bfloat16";
    case ffi::DataType::F16: return "float16";
    case ffi::DataType::F64: return "float64";
    case ffi::DataType::S32: return "int32";
    case ffi::DataType::S64: return "int64";
    default: return "type code " + std::to_string(static_cast<int>(t));
  }
}

// The storage dtype of a float array argument, or an error naming it.
inline ffi::ErrorOr<DType> to_dtype(ffi::DataType t, const char* what) {
  switch (t) {
    case ffi::DataType::F32: return DType::kF32;
    case ffi::DataType::BF16: return DType::kBF16;
    case ffi::DataType::F16: return DType::kF16;
    default:
      return invalid(std::string(what) + ": expected dtype float32, bfloat16 or float16, got " + type_name(t));
  }
}

// The dtypes of a product's input (named `in_name`) and output buffers, or an error naming
// the one that is not float32, bfloat16 or float16.
struct ProductDtypes {
  DType in, out;
};
inline ffi::ErrorOr<ProductDtypes> product_dtypes(ffi::DataType in, const char* in_name, ffi::DataType out) {
  auto in_dtype = to_dtype(in, in_name);
  if (in_dtype.has_error()) return ffi::Unexpected<ffi::Error>(in_dtype.error());
  auto out_dtype = to_dtype(out, "out");
  if (out_dtype.has_error()) return ffi::Unexpected<ffi::Error>(out_dtype.error());
  return ProductDtypes{*in_dtype, *out_dtype};
}

inline ffi::Error expect_shape(const char* what, ffi::AnyBuffer::Dimensions dims,
                               std::initializer_list<int64_t> want) {
  bool ok = dims.size() == want.size();
  size_t i = 0;
  for (int64_t w : want) ok = ok && dims[i++] == w;
  if (ok) return ffi::Error::Success();
  std::string expected = "[";
  i = 0;
  for (int64_t w : want) expected += (i++ ? ", " : "") + std::to_string(w);
  return ffi::Error::InvalidArgument(std::string(what) + ": expected shape " + expected + "], got " +
                                     shape_string(dims));
}

// Fills p.layout, dtypes, pointers and sizes from the call's buffers.
//   gmm:  lhs [M,K], rhs [G,K,N] (or [G,N,K] if transpose_rhs), group_sizes [G], out [M,N]
//   tgmm: lhs [M,K], rhs [M,N], group_sizes [G], out [G,K,N]
inline ffi::ErrorOr<GroupedGemmParams> decode(GroupedLayout layout, ffi::AnyBuffer lhs, ffi::AnyBuffer rhs,
                                              ffi::Buffer<ffi::S32> group_sizes, ffi::AnyBuffer out) {
  if (lhs.dimensions().size() != 2) {
    return invalid("lhs: expected rank 2, got shape " + shape_string(lhs.dimensions()));
  }
  if (group_sizes.dimensions().size() != 1) {
    return invalid("group_sizes: expected rank 1, got shape " +
                                       shape_string(group_sizes.dimensions()));
  }
  if (lhs.element_type() != rhs.element_type()) {
    return invalid("rhs: expected the dtype of lhs (" + type_name(lhs.element_type()) + "), got " +
                   type_name(rhs.element_type()));
  }
  GroupedGemmParams p{};
  p.layout = layout;
  p.m = lhs.dimensions()[0];
  p.k = lhs.dimensions()[1];
  p.num_groups = group_sizes.dimensions()[0];
  const auto rhs_dims = rhs.dimensions();
  if (layout == GroupedLayout::kTgmm) {
    if (rhs_dims.size() != 2 || rhs_dims[0] != p.m) {
      return invalid("rhs: expected shape [" + std::to_string(p.m) + ", N], got " +
                                         shape_string(rhs_dims));
    }
    p.n = rhs_dims[1];
    if (auto e = expect_shape("out", out.dimensions(), {p.num_groups, p.k, p.n}); e.failure()) return ffi::Unexpected<ffi::Error>(e);
  } else {
    const bool t = layout == GroupedLayout::kGmmTransposed;
    if (rhs_dims.size() != 3 || rhs_dims[0] != p.num_groups || rhs_dims[t ? 2 : 1] != p.k) {
      return invalid(
          std::string("rhs: expected shape ") +
          (t ? "[" + std::to_string(p.num_groups) + ", N, " + std::to_string(p.k) + "]"
             : "[" + std::to_string(p.num_groups) + ", " + std::to_string(p.k) + ", N]") +
          ", got " + shape_string(rhs_dims));
    }
    p.n = rhs_dims[t ? 1 : 2];
    if (auto e = expect_shape("out", out.dimensions(), {p.m, p.n}); e.failure()) return ffi::Unexpected<ffi::Error>(e);
  }
  auto dtypes = product_dtypes(lhs.element_type(), "lhs", out.element_type());
  if (dtypes.has_error()) return ffi::Unexpected<ffi::Error>(dtypes.error());
  p.in_dtype = dtypes->in;
  p.out_dtype = dtypes->out;
  p.lhs = lhs.untyped_data();
  p.rhs = rhs.untyped_data();
  p.group_sizes = group_sizes.typed_data();
  p.out = out.untyped_data();
  return p;
}

inline GroupedLayout gmm_layout(bool transpose_rhs) {
  return transpose_rhs ? GroupedLayout::kGmmTransposed : GroupedLayout::kGmm;
}

}  // namespace moe_xla::ffi_args

#endif  // MOE_XLA_FFI_GROUPED_GEMM_ARGS_H_
