// XLA FFI handler of gather_rows on CUDA: decodes, validates and enqueues
// cuda::gather_rows on XLA's stream (no host sync; command-buffer compatible).
#include <cuda_runtime_api.h>

#include <optional>

#include "cuda/gather_rows.h"
#include "ffi/gather_rows_args.h"
#include "ffi/status.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace moe_xla {
namespace {

ffi::Error gather_rows_cuda(cudaStream_t stream, ffi::AnyBuffer values, ffi::AnyBuffer src,
                            std::optional<ffi::AnyBuffer> factor, ffi::Result<ffi::AnyBuffer> rows) {
  auto p = ffi_args::decode_gather_rows(values, src, factor, *rows);
  if (p.has_error()) return p.error();
  return ffi_args::to_error(cuda::gather_rows(*p, stream), "gather_rows");
}

}  // namespace
}  // namespace moe_xla

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeXlaGatherRowsCuda, moe_xla::gather_rows_cuda,
                              moe_xla::ffi_args::bind_gather_rows(
                                  ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});
