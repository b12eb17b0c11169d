// XLA FFI handler of permute (dispatch) on CUDA: decodes, validates, takes the sort's
// workspace from an extra result (ffi/workspace.h) and enqueues cuda::permute on XLA's stream (no
// host sync; command-buffer compatible).
#include <cuda_runtime_api.h>

#include "cuda/routing.h"
#include "ffi/routing_args.h"
#include "ffi/status.h"
#include "ffi/workspace.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace moe_xla {
namespace {

ffi::Error permute_cuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> expert_ids,
                        ffi::Result<ffi::AnyBuffer> x_sorted, ffi::ResultBuffer<ffi::S32> group_sizes,
                        ffi::ResultBuffer<ffi::S32> row_map, ffi::ResultBuffer<ffi::S32> row_pairs,
                        ffi::Result<ffi::AnyBuffer> workspace_buffer) {
  auto p = ffi_args::decode_permute(x, expert_ids, *x_sorted, *group_sizes, *row_map, *row_pairs);
  if (p.has_error()) return p.error();
  const size_t bytes = cuda::permute_workspace_bytes(*p);
  auto workspace = ffi_args::workspace(*workspace_buffer, bytes, "permute");
  if (workspace.has_error()) return workspace.error();
  return ffi_args::to_error(cuda::permute(*p, *workspace, bytes, stream), "permute");
}

}  // namespace
}  // namespace moe_xla

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeXlaPermuteCudaV2, moe_xla::permute_cuda,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()          // x [T, H]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // expert_ids [T, k]
                                  .Ret<ffi::AnyBuffer>()          // x_sorted [T*k, H]
                                  .Ret<ffi::Buffer<ffi::S32>>()   // group_sizes [E]
                                  .Ret<ffi::Buffer<ffi::S32>>()   // row_map [T*k]
                                  .Ret<ffi::Buffer<ffi::S32>>()   // row_pairs [T*k]
                                  .Ret<ffi::AnyBuffer>(),         // workspace u8[MoeXlaPermuteWorkspaceBytes]
                              {ffi::Traits::kCmdBufferCompatible});

// Workspace bytes of a permute call (called from Python through ctypes when lowering).
extern "C" int64_t MoeXlaPermuteWorkspaceBytes(int64_t tokens, int64_t hidden, int64_t top_k, int64_t experts) {
  moe_xla::PermuteParams p{};
  p.tokens = tokens;
  p.hidden = hidden;
  p.top_k = top_k;
  p.experts = experts;
  return static_cast<int64_t>(moe_xla::cuda::permute_workspace_bytes(p));
}
