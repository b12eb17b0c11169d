// XLA FFI handler of gather_gmm on CUDA (contract in common/gather_gemm.h):
//
//   out[r] = x[src[r]] @ w[g]  for the rows r of group g (src outside [0, T): a zero row),
//   rows past the groups 0; out[r] = x[src[r]] @ w[g]^T with the attribute transpose_rhs
//   (w [G, N, K]), as gmm's.
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

#include "common/gather_gemm.h"
#include "common/grouped_gemm.h"
#include "cuda/gather_gemm.h"
#include "ffi/gather_args.h"
#include "ffi/grouped_gemm_args.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace moe_xla {
namespace {

constexpr char kOp[] = "gather_gmm";

// Fills GatherGemmParams from the call's buffers:
//   x [T, K], src [M], w [G, K, N] ([G, N, K] if transpose_rhs), group_sizes [G], out [M, N].
ffi::ErrorOr<GatherGemmParams> decode(ffi::AnyBuffer x, ffi::Buffer<ffi::S32> src, ffi::AnyBuffer w,
                                      ffi::Buffer<ffi::S32> group_sizes, ffi::AnyBuffer out,
                                      bool transpose_rhs) {
  GatherGemmParams p{};
  if (auto e = ffi_args::decode_gather_sizes(p, x, src, "w", w, group_sizes); e.failure()) {
    return ffi::Unexpected<ffi::Error>(e);
  }
  if (auto e = ffi_args::decode_gather_w(p, w, transpose_rhs); e.failure()) {
    return ffi::Unexpected<ffi::Error>(e);
  }
  if (auto e = ffi_args::decode_gather_out(p, x, src, group_sizes, out, {p.m, p.n}); e.failure()) {
    return ffi::Unexpected<ffi::Error>(e);
  }
  return p;
}

ffi::Error gather_gmm_cuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> src, ffi::AnyBuffer w,
                           ffi::Buffer<ffi::S32> group_sizes, ffi::Result<ffi::AnyBuffer> out,
                           ffi::Result<ffi::AnyBuffer> workspace_buffer, bool transpose_rhs) {
  return ffi_args::enqueue_gather<GatherGemmParams>(
      kOp, decode(x, src, w, group_sizes, *out, transpose_rhs), &cuda::gather_gemm_workspace_bytes,
      &cuda::gather_gemm, stream, *workspace_buffer);
}

}  // namespace
}  // namespace moe_xla

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeXlaGatherGmmCudaV2, moe_xla::gather_gmm_cuda,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()  // stream
                                  .Arg<ffi::AnyBuffer>()                     // x [T, K]
                                  .Arg<ffi::Buffer<ffi::S32>>()              // src [M]
                                  .Arg<ffi::AnyBuffer>()                     // w [G, K, N] or [G, N, K]
                                  .Arg<ffi::Buffer<ffi::S32>>()              // group_sizes [G]
                                  .Ret<ffi::AnyBuffer>()                     // out [M, N]
                                  .Ret<ffi::AnyBuffer>()  // workspace u8[MoeXlaGatherGmmWorkspaceBytes(M, G)]
                                  .Attr<bool>("transpose_rhs"),  // w is [G, N, K]
                              {ffi::Traits::kCmdBufferCompatible});

// Workspace bytes of a gather_gmm call with M output rows and `num_groups` groups, any K,
// N and dtypes (called from Python through ctypes when lowering).
extern "C" int64_t MoeXlaGatherGmmWorkspaceBytes(int64_t m, int64_t num_groups) {
  return static_cast<int64_t>(moe_xla::cuda::gather_gemm_workspace_bytes(m, num_groups));
}
