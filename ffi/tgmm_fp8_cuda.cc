// XLA FFI handler of tgmm_fp8 (the FP8 wgrad) on CUDA: decode and validate
// (ffi/fp8_gemm_args.h), take the workspace result (ffi/workspace.h) and enqueue
// cuda::fp8_wgrad on XLA's stream. No host copy, no synchronisation, nothing cached between
// calls: command-buffer (CUDA graph) compatible.
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "cuda/device.h"
#include "cuda/fp8_wgrad.h"
#include "ffi/fp8_gemm_args.h"
#include "ffi/status.h"
#include "ffi/workspace.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace moe_xla {
namespace {

ffi::Error tgmm_fp8_cuda(cudaStream_t stream, ffi::AnyBuffer lhs_t, ffi::Buffer<ffi::F32> lhs_scales,
                         ffi::AnyBuffer rhs_t, ffi::Buffer<ffi::F32> rhs_scales, ffi::Buffer<ffi::S32> group_sizes,
                         ffi::Result<ffi::AnyBuffer> out, int64_t rows, int32_t path,
                         ffi::Result<ffi::AnyBuffer> workspace_buffer) {
  auto p = ffi_args::decode_fp8_wgrad(lhs_t, lhs_scales, rhs_t, rhs_scales, group_sizes, *out, rows);
  if (p.has_error()) return p.error();
  if (path < 0 || path >= cuda::kFp8WgradPathCount) {
    return ffi::Error::InvalidArgument("moe_xla tgmm_fp8: path: expected a cuda::Fp8WgradPath value 0 .. " +
                                       std::to_string(cuda::kFp8WgradPathCount - 1) + ", got " +
                                       std::to_string(path));
  }
  int sm_count = 0;
  if (Status s = cuda::current_device_sm_count(&sm_count); !s.ok()) return ffi_args::to_error(s, "tgmm_fp8");
  if (auto e = ffi_args::check_sm_count(sm_count, "tgmm_fp8"); e.failure()) return e;
  const size_t bytes = cuda::fp8_wgrad_workspace_bytes_bound(p->num_groups, sm_count);
  auto workspace = ffi_args::workspace(*workspace_buffer, bytes, "tgmm_fp8");
  if (workspace.has_error()) return workspace.error();
  return ffi_args::to_error(
      cuda::fp8_wgrad(*p, *workspace, bytes, sm_count, stream, static_cast<cuda::Fp8WgradPath>(path)), "tgmm_fp8");
}

}  // namespace
}  // namespace moe_xla

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeXlaTgmmFp8Cuda, moe_xla::tgmm_fp8_cuda,
                              moe_xla::ffi_args::bind_fp8_wgrad(
                                  ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>())
                                  .Ret<ffi::AnyBuffer>(),  // workspace u8[MoeXlaTgmmFp8WorkspaceBytes(G)]
                              {ffi::Traits::kCmdBufferCompatible});

// Workspace bytes of a tgmm_fp8 call with `num_groups` groups, any shape and dtype (called
// from Python through ctypes when lowering).
extern "C" int64_t MoeXlaTgmmFp8WorkspaceBytes(int64_t num_groups) {
  using moe_xla::ffi_args::kMaxSmCount;
  return static_cast<int64_t>(moe_xla::cuda::fp8_wgrad_workspace_bytes_bound(num_groups, kMaxSmCount));
}
