// XLA FFI handler of gather_tgmm on CUDA (contract in common/gather_tgmm.h):
//
//   out[g] = sum over the rows r of group g of x[src[r]]^T (outer) dy[r]      [G, K, N]
//   (src outside [0, T): a zero row of x), empty groups 0; with the attribute
//   transpose_out each block transposed, out [G, N, K].
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
#include "ffi/gather_args.h"
#include "ffi/grouped_gemm_args.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace moe_xla {
namespace {

constexpr char kOp[] = "gather_tgmm";

// Fills GatherTgmmParams from the call's buffers:
//   x [T, K], src [M], dy [M, N], group_sizes [G], out [G, K, N] ([G, N, K] if transpose_out).
ffi::ErrorOr<GatherTgmmParams> decode(ffi::AnyBuffer x, ffi::Buffer<ffi::S32> src, ffi::AnyBuffer dy,
                                      ffi::Buffer<ffi::S32> group_sizes, ffi::AnyBuffer out, bool transpose_out) {
  using ffi_args::invalid;
  using ffi_args::shape_string;
  GatherTgmmParams p{};
  if (auto e = ffi_args::decode_gather_sizes(p, x, src, "dy", dy, group_sizes); e.failure()) {
    return ffi::Unexpected<ffi::Error>(e);
  }
  const auto dy_dims = dy.dimensions();
  if (dy_dims.size() != 2 || dy_dims[0] != p.m) {
    return invalid("dy: expected shape [" + std::to_string(p.m) + ", N], got " + shape_string(dy_dims));
  }
  p.n = dy_dims[1];
  p.transpose_out = transpose_out;
  const int64_t rows = transpose_out ? p.n : p.k, cols = transpose_out ? p.k : p.n;
  if (auto e = ffi_args::decode_gather_out(p, x, src, group_sizes, out, {p.num_groups, rows, cols}); e.failure()) {
    return ffi::Unexpected<ffi::Error>(e);
  }
  p.dy = dy.untyped_data();
  return p;
}

ffi::Error gather_tgmm_cuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> src, ffi::AnyBuffer dy,
                            ffi::Buffer<ffi::S32> group_sizes, ffi::Result<ffi::AnyBuffer> out,
                            ffi::Result<ffi::AnyBuffer> workspace_buffer, bool transpose_out) {
  return ffi_args::enqueue_gather<GatherTgmmParams>(kOp, decode(x, src, dy, group_sizes, *out, transpose_out),
                                             &cuda::gather_tgmm_workspace_bytes, &cuda::gather_tgmm,
                                             stream, *workspace_buffer);
}

}  // namespace
}  // namespace moe_xla

// V2: the attribute transpose_out (moe_xla/_lib.py's versions).
XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeXlaGatherTgmmCudaV2, moe_xla::gather_tgmm_cuda,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()  // stream
                                  .Arg<ffi::AnyBuffer>()                     // x [T, K]
                                  .Arg<ffi::Buffer<ffi::S32>>()              // src [M]
                                  .Arg<ffi::AnyBuffer>()                     // dy [M, N]
                                  .Arg<ffi::Buffer<ffi::S32>>()              // group_sizes [G]
                                  .Ret<ffi::AnyBuffer>()                     // out [G, K, N] or [G, N, K]
                                  .Ret<ffi::AnyBuffer>()  // workspace u8[MoeXlaGatherTgmmWorkspaceBytes(G)]
                                  .Attr<bool>("transpose_out"),  // out [G, N, K]
                              {ffi::Traits::kCmdBufferCompatible});

// Workspace bytes of a gather_tgmm call with `num_groups` groups, any T, M, K, N and dtypes
// (called from Python through ctypes when lowering).
extern "C" int64_t MoeXlaGatherTgmmWorkspaceBytes(int64_t num_groups) {
  return static_cast<int64_t>(moe_xla::cuda::gather_tgmm_workspace_bytes(num_groups));
}
