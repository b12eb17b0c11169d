// XLA FFI handler of gmm_fp8 (the FP8 blockwise grouped product) on CUDA: decode and
// validate (ffi/fp8_gemm_args.h), take the workspace result (ffi/workspace.h) and enqueue
// cuda::fp8_grouped_gemm on XLA's stream. No host copy, no synchronisation, nothing cached
// between calls: command-buffer (CUDA graph) compatible.
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <iterator>
#include <string>

#include "cuda/device.h"
#include "cuda/fp8_grouped_gemm.h"
#include "ffi/fp8_gemm_args.h"
#include "ffi/status.h"
#include "ffi/workspace.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace moe_xla {
namespace {

ffi::Error gmm_fp8_cuda(cudaStream_t stream, ffi::AnyBuffer lhs, ffi::Buffer<ffi::F32> lhs_scales, ffi::AnyBuffer rhs,
                        ffi::Buffer<ffi::F32> rhs_scales, ffi::Buffer<ffi::S32> group_sizes,
                        ffi::Result<ffi::AnyBuffer> out, int32_t path,
                        ffi::Result<ffi::AnyBuffer> workspace_buffer) {
  auto p = ffi_args::decode_fp8_gemm(lhs, lhs_scales, rhs, rhs_scales, group_sizes, *out);
  if (p.has_error()) return p.error();
  // kAuto (0), then one value per path of kFp8GemmPaths, numbered 1 .. N.
  const int32_t last = static_cast<int32_t>(std::size(cuda::kFp8GemmPaths));
  if (path < 0 || path > last) {
    return ffi::Error::InvalidArgument("moe_xla gmm_fp8: path: expected a cuda::Fp8GemmPath value 0 .. " +
                                       std::to_string(last) + ", got " + std::to_string(path));
  }
  int sm_count = 0;
  if (Status s = cuda::current_device_sm_count(&sm_count); !s.ok()) return ffi_args::to_error(s, "gmm_fp8");
  if (auto e = ffi_args::check_sm_count(sm_count, "gmm_fp8"); e.failure()) return e;
  const size_t bytes = cuda::fp8_grouped_gemm_workspace_bytes_bound(p->m, p->num_groups, sm_count);
  auto workspace = ffi_args::workspace(*workspace_buffer, bytes, "gmm_fp8");
  if (workspace.has_error()) return workspace.error();
  return ffi_args::to_error(
      cuda::fp8_grouped_gemm(*p, *workspace, bytes, sm_count, stream, static_cast<cuda::Fp8GemmPath>(path)), "gmm_fp8");
}

}  // namespace
}  // namespace moe_xla

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeXlaGmmFp8Cuda, moe_xla::gmm_fp8_cuda,
                              moe_xla::ffi_args::bind_fp8_gemm(
                                  ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>())
                                  .Ret<ffi::AnyBuffer>(),  // workspace u8[MoeXlaGmmFp8WorkspaceBytes(M, G)]
                              {ffi::Traits::kCmdBufferCompatible});

// Workspace bytes of a gmm_fp8 call with `m` rows in `num_groups` groups, any K, N and
// dtype (called from Python through ctypes when lowering).
extern "C" int64_t MoeXlaGmmFp8WorkspaceBytes(int64_t m, int64_t num_groups) {
  using moe_xla::ffi_args::kMaxSmCount;
  return static_cast<int64_t>(moe_xla::cuda::fp8_grouped_gemm_workspace_bytes_bound(m, num_groups, kMaxSmCount));
}
