// XLA FFI handler of unpermute (combine) on CUDA: decodes, validates and enqueues
// cuda::unpermute on XLA's stream (no host sync; command-buffer compatible).
#include <cuda_runtime_api.h>

#include "cuda/routing.h"
#include "ffi/routing_args.h"
#include "ffi/status.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace moe_xla {
namespace {

ffi::Error unpermute_cuda(cudaStream_t stream, ffi::AnyBuffer y_sorted,
                          ffi::Buffer<ffi::S32> row_map, ffi::RemainingArgs weights,
                          ffi::Result<ffi::AnyBuffer> y) {
  auto p = ffi_args::decode_unpermute(y_sorted, row_map, weights, *y);
  if (p.has_error()) return p.error();
  return ffi_args::to_error(cuda::unpermute(*p, stream), "unpermute");
}

}  // namespace
}  // namespace moe_xla

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeXlaUnpermuteCudaV2, moe_xla::unpermute_cuda,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()          // y_sorted [R, H]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // row_map [T*k]
                                  .RemainingArgs()                // weights [T, k], or none: every weight 1
                                  .Ret<ffi::AnyBuffer>(),         // y [T, H]
                              {ffi::Traits::kCmdBufferCompatible});
