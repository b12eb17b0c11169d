// Decoding and enqueueing shared by the CUDA handlers of the gather products
// (gather_gmm_cuda.cc, gather_tgmm_cuda.cc). Their params (GatherGemmParams,
// GatherTgmmParams) name x [T, K], src [M], group_sizes [G], out and the dtypes alike;
// only the second operand (w or dy) and out's shape differ. decode_gather_w decodes
// gather_gmm's w in either layout.
#ifndef MOE_XLA_FFI_GATHER_ARGS_H_
#define MOE_XLA_FFI_GATHER_ARGS_H_

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>

#include "common/gather_gemm.h"
#include "common/status.h"
#include "ffi/grouped_gemm_args.h"
#include "ffi/status.h"
#include "ffi/workspace.h"
#include "xla/ffi/api/ffi.h"

namespace moe_xla::ffi_args {

// Checks the ranks of x [T, K], src [M] and group_sizes [G] and that `other` (named
// other_name in the message) has x's dtype; fills p.tokens, k, m and num_groups.
template <class Params>
ffi::Error decode_gather_sizes(Params& p, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> src,
                               const char* other_name, ffi::AnyBuffer other,
                               ffi::Buffer<ffi::S32> group_sizes) {
  if (x.dimensions().size() != 2) {
    return ffi::Error::InvalidArgument("x: expected rank 2, got shape " + shape_string(x.dimensions()));
  }
  if (src.dimensions().size() != 1) {
    return ffi::Error::InvalidArgument("src: expected rank 1, got shape " + shape_string(src.dimensions()));
  }
  if (group_sizes.dimensions().size() != 1) {
    return ffi::Error::InvalidArgument("group_sizes: expected rank 1, got shape " +
                                       shape_string(group_sizes.dimensions()));
  }
  if (other.element_type() != x.element_type()) {
    return ffi::Error::InvalidArgument(std::string(other_name) + ": expected the dtype of x (" +
                                       type_name(x.element_type()) + "), got " +
                                       type_name(other.element_type()));
  }
  p.tokens = x.dimensions()[0];
  p.k = x.dimensions()[1];
  p.m = src.dimensions()[0];
  p.num_groups = group_sizes.dimensions()[0];
  return ffi::Error::Success();
}

// Checks w's shape for its layout, [G, K, N] or, with transpose_w, [G, N, K] (G and K as
// decode_gather_sizes filled them); fills p.n, p.w and p.transpose_w.
inline ffi::Error decode_gather_w(GatherGemmParams& p, ffi::AnyBuffer w, bool transpose_w) {
  const auto dims = w.dimensions();
  const size_t k_axis = transpose_w ? 2 : 1;
  if (dims.size() != 3 || dims[0] != p.num_groups || dims[k_axis] != p.k) {
    const std::string g = std::to_string(p.num_groups), k = std::to_string(p.k);
    const std::string expected = transpose_w ? "[G, N, K] = [" + g + ", N, " + k + "] (transpose_rhs)"
                                             : "[G, K, N] = [" + g + ", " + k + ", N]";
    return ffi::Error::InvalidArgument("w: expected shape " + expected + ", got " + shape_string(dims));
  }
  p.n = dims[transpose_w ? 1 : 2];
  p.w = w.untyped_data();
  p.transpose_w = transpose_w;
  return ffi::Error::Success();
}

// Checks that out has the shape `out_shape` and that the dtypes are supported; fills
// p.in_dtype, out_dtype and the pointers of x, src, group_sizes and out.
template <class Params>
ffi::Error decode_gather_out(Params& p, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> src,
                             ffi::Buffer<ffi::S32> group_sizes, ffi::AnyBuffer out,
                             std::initializer_list<int64_t> out_shape) {
  if (auto e = expect_shape("out", out.dimensions(), out_shape); e.failure()) return e;
  auto dtypes = product_dtypes(x.element_type(), "x", out.element_type());
  if (dtypes.has_error()) return dtypes.error();
  p.in_dtype = dtypes->in;
  p.out_dtype = dtypes->out;
  p.x = x.untyped_data();
  p.src = src.typed_data();
  p.group_sizes = group_sizes.typed_data();
  p.out = out.untyped_data();
  return ffi::Error::Success();
}

// Enqueues `run` (cuda::gather_gemm or cuda::gather_tgmm) on `stream` with the decoded
// params and the workspace result, after checking that it holds workspace_bytes(params);
// errors name `op`.
template <class Params>
ffi::Error enqueue_gather(const char* op, const ffi::ErrorOr<Params>& params,
                          size_t (*workspace_bytes)(const Params&),
                          Status (*run)(const Params&, void*, size_t, cudaStream_t),
                          cudaStream_t stream, ffi::AnyBuffer workspace_buffer) {
  if (params.has_error()) return params.error();
  const Params& p = *params;
  auto workspace = ffi_args::workspace(workspace_buffer, workspace_bytes(p), op);
  if (workspace.has_error()) return workspace.error();
  return to_error(run(p, *workspace, workspace_buffer.size_bytes(), stream), op);
}

}  // namespace moe_xla::ffi_args

#endif  // MOE_XLA_FFI_GATHER_ARGS_H_
