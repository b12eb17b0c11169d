// XLA FFI handler of gather_gmm on CUDA (contract in common/gather_gemm.h):
//
//   out[r] = x[src[r]] @ w[g]  for the rows r of group g (src outside [0, T): a zero row),
//   rows past the groups 0.
//
// It decodes and validates the buffers into GatherGemmParams, uses the workspace result
// (ffi/workspace.h, sized by MoeXlaGatherGmmWorkspaceBytes) and enqueues
// moe_xla::cuda::gather_gemm on XLA's stream. The Python lowering emits this call only for
// the cases the kernel supports (bf16 x and w, bf16 or f32 out, K and N multiples of 8);
// the kernel itself checks the device (Hopper, compute capability 9.0) and returns a
// FailedPrecondition naming it elsewhere. Group sizes and src stay on the device, nothing
// synchronises and nothing is cached between calls: command-buffer (CUDA graph) compatible.
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "common/gather_gemm.h"
#include "common/grouped_gemm.h"
#include "cuda/gather_gemm.h"
#include "ffi/grouped_gemm_args.h"
#include "ffi/status.h"
#include "ffi/workspace.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace moe_xla {
namespace {

constexpr char kOp[] = "gather_gmm";

// Fills GatherGemmParams from the call's buffers:
//   x [T, K], src [M], w [G, K, N], group_sizes [G], out [M, N].
ffi::ErrorOr<GatherGemmParams> decode(ffi::AnyBuffer x, ffi::Buffer<ffi::S32> src, ffi::AnyBuffer w,
                                      ffi::Buffer<ffi::S32> group_sizes, ffi::AnyBuffer out) {
  using ffi_args::invalid;
  using ffi_args::shape_string;
  if (x.dimensions().size() != 2) return invalid("x: expected rank 2, got shape " + shape_string(x.dimensions()));
  if (src.dimensions().size() != 1) {
    return invalid("src: expected rank 1, got shape " + shape_string(src.dimensions()));
  }
  if (group_sizes.dimensions().size() != 1) {
    return invalid("group_sizes: expected rank 1, got shape " + shape_string(group_sizes.dimensions()));
  }
  if (w.element_type() != x.element_type()) {
    return invalid("w: expected the dtype of x (" + ffi_args::type_name(x.element_type()) + "), got " +
                   ffi_args::type_name(w.element_type()));
  }
  GatherGemmParams p{};
  p.tokens = x.dimensions()[0];
  p.k = x.dimensions()[1];
  p.m = src.dimensions()[0];
  p.num_groups = group_sizes.dimensions()[0];
  const auto w_dims = w.dimensions();
  if (w_dims.size() != 3 || w_dims[0] != p.num_groups || w_dims[1] != p.k) {
    return invalid("w: expected shape [" + std::to_string(p.num_groups) + ", " + std::to_string(p.k) +
                   ", N], got " + shape_string(w_dims));
  }
  p.n = w_dims[2];
  if (auto e = ffi_args::expect_shape("out", out.dimensions(), {p.m, p.n}); e.failure()) {
    return ffi::Unexpected<ffi::Error>(e);
  }
  auto dtypes = ffi_args::product_dtypes(x.element_type(), "x", out.element_type());
  if (dtypes.has_error()) return ffi::Unexpected<ffi::Error>(dtypes.error());
  p.in_dtype = dtypes->in;
  p.out_dtype = dtypes->out;
  p.x = x.untyped_data();
  p.src = src.typed_data();
  p.w = w.untyped_data();
  p.group_sizes = group_sizes.typed_data();
  p.out = out.untyped_data();
  return p;
}

ffi::Error gather_gmm_cuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> src, ffi::AnyBuffer w,
                           ffi::Buffer<ffi::S32> group_sizes, ffi::Result<ffi::AnyBuffer> out,
                           ffi::Result<ffi::AnyBuffer> workspace_buffer) {
  auto params = decode(x, src, w, group_sizes, *out);
  if (params.has_error()) return params.error();
  const GatherGemmParams& p = *params;
  const size_t workspace_bytes = cuda::gather_gemm_workspace_bytes(p);
  auto workspace = ffi_args::workspace(*workspace_buffer, workspace_bytes, kOp);
  if (workspace.has_error()) return workspace.error();
  return ffi_args::to_error(cuda::gather_gemm(p, *workspace, workspace_buffer->size_bytes(), stream), kOp);
}

}  // namespace
}  // namespace moe_xla

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeXlaGatherGmmCuda, moe_xla::gather_gmm_cuda,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()  // stream
                                  .Arg<ffi::AnyBuffer>()                     // x [T, K]
                                  .Arg<ffi::Buffer<ffi::S32>>()              // src [M]
                                  .Arg<ffi::AnyBuffer>()                     // w [G, K, N]
                                  .Arg<ffi::Buffer<ffi::S32>>()              // group_sizes [G]
                                  .Ret<ffi::AnyBuffer>()                     // out [M, N]
                                  .Ret<ffi::AnyBuffer>(),  // workspace u8[MoeXlaGatherGmmWorkspaceBytes(M, G)]
                              {ffi::Traits::kCmdBufferCompatible});

// Workspace bytes of a gather_gmm call with M output rows and `num_groups` groups, any K,
// N and dtypes (called from Python through ctypes when lowering).
extern "C" int64_t MoeXlaGatherGmmWorkspaceBytes(int64_t m, int64_t num_groups) {
  return static_cast<int64_t>(moe_xla::cuda::gather_gemm_workspace_bytes(m, num_groups));
}
