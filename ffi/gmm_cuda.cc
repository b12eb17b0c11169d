// XLA FFI handlers of gmm and tgmm on CUDA.
//
// They decode and validate the buffers (ffi/grouped_gemm_args.h), use the workspace
// result (ffi/workspace.h) and enqueue moe_xla::cuda::grouped_gemm on XLA's stream. Group
// sizes are never copied to the host, nothing synchronises and nothing is cached between
// calls, so the handlers are command-buffer (CUDA graph) compatible.
#include <cuda_runtime_api.h>

#include <cstddef>
#include <string>

#include "common/grouped_gemm.h"
#include "cuda/device.h"
#include "cuda/grouped_gemm.h"
#include "ffi/grouped_gemm_args.h"
#include "ffi/status.h"
#include "ffi/workspace.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace moe_xla {
namespace {

ffi::Error run(cudaStream_t stream, ffi::AnyBuffer workspace_buffer, ffi::ErrorOr<GroupedGemmParams> params,
               const char* op) {
  if (params.has_error()) return params.error();
  const GroupedGemmParams& p = *params;

  int sm_count = 0;
  if (Status s = cuda::current_device_sm_count(&sm_count); !s.ok()) return ffi_args::to_error(s, op);

  if (auto e = ffi_args::check_sm_count(sm_count, op); e.failure()) return e;
  const size_t workspace_bytes = cuda::grouped_gemm_workspace_bytes(p, sm_count);
  auto workspace = ffi_args::workspace(workspace_buffer, workspace_bytes, op);
  if (workspace.has_error()) return workspace.error();
  return ffi_args::to_error(cuda::grouped_gemm(p, *workspace, workspace_bytes, sm_count, stream), op);
}

ffi::Error gmm_cuda(cudaStream_t stream, ffi::AnyBuffer lhs, ffi::AnyBuffer rhs,
                    ffi::Buffer<ffi::S32> group_sizes, ffi::Result<ffi::AnyBuffer> out,
                    ffi::Result<ffi::AnyBuffer> workspace, bool transpose_rhs) {
  return run(stream, *workspace,
             ffi_args::decode(ffi_args::gmm_layout(transpose_rhs), lhs, rhs, group_sizes, *out), "gmm");
}

ffi::Error tgmm_cuda(cudaStream_t stream, ffi::AnyBuffer lhs, ffi::AnyBuffer rhs,
                     ffi::Buffer<ffi::S32> group_sizes, ffi::Result<ffi::AnyBuffer> out,
                     ffi::Result<ffi::AnyBuffer> workspace) {
  return run(stream, *workspace,
             ffi_args::decode(GroupedLayout::kTgmm, lhs, rhs, group_sizes, *out), "tgmm");
}

}  // namespace
}  // namespace moe_xla

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeXlaGmmCuda, moe_xla::gmm_cuda,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()  // stream
                                  .Arg<ffi::AnyBuffer>()                     // lhs [M, K]
                                  .Arg<ffi::AnyBuffer>()  // rhs [G, K, N] or [G, N, K]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // group_sizes [G]
                                  .Ret<ffi::AnyBuffer>()         // out [M, N]
                                  .Ret<ffi::AnyBuffer>()         // workspace u8[MoeXlaGmmWorkspaceBytes(M, G)]
                                  .Attr<bool>("transpose_rhs"),  // transpose_rhs
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeXlaTgmmCuda, moe_xla::tgmm_cuda,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()  // stream
                                  .Arg<ffi::AnyBuffer>()                     // lhs [M, K]
                                  .Arg<ffi::AnyBuffer>()                     // rhs [M, N]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // group_sizes [G]
                                  .Ret<ffi::AnyBuffer>()         // out [G, K, N]
                                  .Ret<ffi::AnyBuffer>(),        // workspace u8[MoeXlaGmmWorkspaceBytes(M, G)]
                              {ffi::Traits::kCmdBufferCompatible});

// Workspace bytes of a gmm / tgmm call with `m` rows of lhs and `num_groups` groups, any
// K, N and dtype (called from Python through ctypes when lowering).
extern "C" int64_t MoeXlaGmmWorkspaceBytes(int64_t m, int64_t num_groups) {
  using moe_xla::ffi_args::kMaxSmCount;
  return static_cast<int64_t>(moe_xla::cuda::grouped_gemm_workspace_bytes_bound(m, num_groups, kMaxSmCount));
}
