// XLA FFI handler of gather_tgmm on CUDA (contract in common/gather_tgmm.h):
//
//   out[g] = sum over the rows r of group g of x[src[r]]^T (outer) dy[r]
//   (src outside [0, T): a zero row of x), empty groups 0.
//
// It decodes and validates the buffers into GatherTgmmParams, uses the workspace result
// (ffi/workspace.h, sized by MoeXlaGatherTgmmWorkspaceBytes) and enqueues
// moe_xla::cuda::gather_tgmm on XLA's stream. The Python lowering emits this call only for
// the cases the kernel supports (bf16 x and dy, bf16 or f32 out, K and N multiples of 8);
// the kernel itself checks the device (Hopper, compute capability 9.0) and returns a
// FailedPrecondition naming it elsewhere. Group sizes and src stay on the device, nothing
// synchronises and nothing is cached between calls: command-buffer (CUDA graph) compatible.
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "common/gather_tgmm.h"
#include "common/grouped_gemm.h"
#include "cuda/gather_tgmm.h"
#include "ffi/grouped_gemm_args.h"
#include "ffi/status.h"
#include "ffi/workspace.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace moe_xla {
namespace {

constexpr char kOp[] = "gather_tgmm";

// Fills GatherTgmmParams from the call's buffers:
//   x [T, K], src [M], dy [M, N], group_sizes [G], out [G, K, N].
ffi::ErrorOr<GatherTgmmParams> decode(ffi::AnyBuffer x, ffi::Buffer<ffi::S32> src, ffi::AnyBuffer dy,
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
  if (dy.element_type() != x.element_type()) {
    return invalid("dy: expected the dtype of x (" + ffi_args::type_name(x.element_type()) + "), got " +
                   ffi_args::type_name(dy.element_type()));
  }
  GatherTgmmParams p{};
  p.tokens = x.dimensions()[0];
  p.k = x.dimensions()[1];
  p.m = src.dimensions()[0];
  p.num_groups = group_sizes.dimensions()[0];
  const auto dy_dims = dy.dimensions();
  if (dy_dims.size() != 2 || dy_dims[0] != p.m) {
    return invalid("dy: expected shape [" + std::to_string(p.m) + ", N], got " + shape_string(dy_dims));
  }
  p.n = dy_dims[1];
  if (auto e = ffi_args::expect_shape("out", out.dimensions(), {p.num_groups, p.k, p.n}); e.failure()) {
    return ffi::Unexpected<ffi::Error>(e);
  }
  auto dtypes = ffi_args::product_dtypes(x.element_type(), "x", out.element_type());
  if (dtypes.has_error()) return ffi::Unexpected<ffi::Error>(dtypes.error());
  p.in_dtype = dtypes->in;
  p.out_dtype = dtypes->out;
  p.x = x.untyped_data();
  p.src = src.typed_data();
  p.dy = dy.untyped_data();
  p.group_sizes = group_sizes.typed_data();
  p.out = out.untyped_data();
  return p;
}

ffi::Error gather_tgmm_cuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> src, ffi::AnyBuffer dy,
                            ffi::Buffer<ffi::S32> group_sizes, ffi::Result<ffi::AnyBuffer> out,
                            ffi::Result<ffi::AnyBuffer> workspace_buffer) {
  auto params = decode(x, src, dy, group_sizes, *out);
  if (params.has_error()) return params.error();
  const GatherTgmmParams& p = *params;
  const size_t workspace_bytes = cuda::gather_tgmm_workspace_bytes(p);
  auto workspace = ffi_args::workspace(*workspace_buffer, workspace_bytes, kOp);
  if (workspace.has_error()) return workspace.error();
  return ffi_args::to_error(cuda::gather_tgmm(p, *workspace, workspace_buffer->size_bytes(), stream), kOp);
}

}  // namespace
}  // namespace moe_xla

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeXlaGatherTgmmCuda, moe_xla::gather_tgmm_cuda,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()  // stream
                                  .Arg<ffi::AnyBuffer>()                     // x [T, K]
                                  .Arg<ffi::Buffer<ffi::S32>>()              // src [M]
                                  .Arg<ffi::AnyBuffer>()                     // dy [M, N]
                                  .Arg<ffi::Buffer<ffi::S32>>()              // group_sizes [G]
                                  .Ret<ffi::AnyBuffer>()                     // out [G, K, N]
                                  .Ret<ffi::AnyBuffer>(),  // workspace u8[MoeXlaGatherTgmmWorkspaceBytes(G)]
                              {ffi::Traits::kCmdBufferCompatible});

// Workspace bytes of a gather_tgmm call with `num_groups` groups, any T, M, K, N and dtypes
// (called from Python through ctypes when lowering).
extern "C" int64_t MoeXlaGatherTgmmWorkspaceBytes(int64_t num_groups) {
  return static_cast<int64_t>(moe_xla::cuda::gather_tgmm_workspace_bytes(num_groups));
}
