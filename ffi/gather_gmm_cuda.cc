// XLA FFI handlers of gather_gmm and gather_gmm_activate on CUDA (contract in
// common/gather_gemm.h):
//
//   gather_gmm:           out[r] = x[src[r]] @ w[g]  for the rows r of group g (src outside
//                         [0, T): a zero row), rows past the groups 0; out[r] = x[src[r]] @ w[g]^T
//                         with the attribute transpose_rhs (w [G, N, K]), as gmm's.
//   gather_gmm_activate:  out[r] = act(x[src[r]] @ w[g]), the activation (attribute
//                         `activation`, the Activation of common/expert_activation.h) applied
//                         to the float32 product before its rounding; out [M, N / 2] for the
//                         gated ones (w [G, K, 2F] = gate | up), [M, N] otherwise.
//
// Each decodes and validates the buffers into GatherGemmParams, uses the workspace result
// (ffi/workspace.h, sized by MoeXlaGatherGmmWorkspaceBytes) and enqueues
// moe_xla::cuda::gather_gemm on XLA's stream. The Python lowering emits this call only for
// the cases the kernel supports (bf16 x and w, bf16 or f32 out, K and N multiples of 8;
// gather_gmm_activate's also needs bf16 out, and F % 128 == 0 for the gated activations);
// the kernel itself checks the device (Hopper, compute capability 9.0) and returns a
// FailedPrecondition naming it elsewhere. Group sizes and src stay on the device, nothing
// synchronises and nothing is cached between calls: command-buffer (CUDA graph) compatible.
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include <string>

#include "common/expert_activation.h"
#include "common/gather_gemm.h"
#include "common/grouped_gemm.h"
#include "cuda/gather_gemm.h"
#include "ffi/gather_args.h"
#include "ffi/grouped_gemm_args.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace moe_xla {
namespace {

// Fills GatherGemmParams from the call's buffers:
//   x [T, K], src [M], w [G, K, N] ([G, N, K] if transpose_rhs), group_sizes [G], out [M, N]
//   (out [M, N / 2] when activated by a gated activation: N even, checked here).
ffi::ErrorOr<GatherGemmParams> decode(ffi::AnyBuffer x, ffi::Buffer<ffi::S32> src, ffi::AnyBuffer w,
                                      ffi::Buffer<ffi::S32> group_sizes, ffi::AnyBuffer out,
                                      bool transpose_rhs, bool activated, Activation activation) {
  GatherGemmParams p{};
  if (auto e = ffi_args::decode_gather_sizes(p, x, src, "w", w, group_sizes); e.failure()) {
    return ffi::Unexpected<ffi::Error>(e);
  }
  if (auto e = ffi_args::decode_gather_w(p, w, transpose_rhs); e.failure()) {
    return ffi::Unexpected<ffi::Error>(e);
  }
  p.activated = activated;
  p.activation = activation;
  const bool gated = activated && is_gated(activation);
  if (gated && p.n % 2 != 0) {
    return ffi::Unexpected<ffi::Error>(ffi::Error::InvalidArgument(
        "w: a gated activation needs an even N = 2F (gate | up), got N = " + std::to_string(p.n)));
  }
  if (auto e = ffi_args::decode_gather_out(p, x, src, group_sizes, out, {p.m, gated ? p.n / 2 : p.n});
      e.failure()) {
    return ffi::Unexpected<ffi::Error>(e);
  }
  return p;
}

ffi::Error gather_gmm_cuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> src, ffi::AnyBuffer w,
                           ffi::Buffer<ffi::S32> group_sizes, ffi::Result<ffi::AnyBuffer> out,
                           ffi::Result<ffi::AnyBuffer> workspace_buffer, bool transpose_rhs) {
  return ffi_args::enqueue_gather<GatherGemmParams>(
      "gather_gmm", decode(x, src, w, group_sizes, *out, transpose_rhs, false, Activation::kSwiglu),
      &cuda::gather_gemm_workspace_bytes, &cuda::gather_gemm, stream, *workspace_buffer);
}

ffi::Error gather_gmm_activate_cuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> src,
                                    ffi::AnyBuffer w, ffi::Buffer<ffi::S32> group_sizes,
                                    ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> workspace_buffer,
                                    int32_t activation) {
  constexpr char kOp[] = "gather_gmm_activate";
  if (activation < 0 || activation >= kNumActivations) {
    return ffi::Error::InvalidArgument(std::string(kOp) + ": activation: expected 0 .. " +
                                       std::to_string(kNumActivations - 1) + ", got " + std::to_string(activation));
  }
  return ffi_args::enqueue_gather<GatherGemmParams>(
      kOp, decode(x, src, w, group_sizes, *out, false, true, static_cast<Activation>(activation)),
      &cuda::gather_gemm_workspace_bytes, &cuda::gather_gemm, stream, *workspace_buffer);
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

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeXlaGatherGmmActivateCudaV1, moe_xla::gather_gmm_activate_cuda,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()  // stream
                                  .Arg<ffi::AnyBuffer>()                     // x [T, K]
                                  .Arg<ffi::Buffer<ffi::S32>>()              // src [M]
                                  .Arg<ffi::AnyBuffer>()                     // w [G, K, N]
                                  .Arg<ffi::Buffer<ffi::S32>>()              // group_sizes [G]
                                  .Ret<ffi::AnyBuffer>()  // out [M, N / 2] (gated) or [M, N]
                                  .Ret<ffi::AnyBuffer>()  // workspace u8[MoeXlaGatherGmmWorkspaceBytes(M, G)]
                                  .Attr<int32_t>("activation"),  // Activation (common/expert_activation.h)
                              {ffi::Traits::kCmdBufferCompatible});

// Workspace bytes of a gather_gmm or gather_gmm_activate call with M output rows and `num_groups` groups, any K,
// N and dtypes (called from Python through ctypes when lowering).
extern "C" int64_t MoeXlaGatherGmmWorkspaceBytes(int64_t m, int64_t num_groups) {
  return static_cast<int64_t>(moe_xla::cuda::gather_gemm_workspace_bytes(m, num_groups));
}
