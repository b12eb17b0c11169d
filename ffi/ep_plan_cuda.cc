// XLA FFI handlers of the EP dispatch plan (ep_dedup_rows, ep_row_places) on CUDA:
// decode, validate and enqueue the kernels on XLA's stream (no host sync;
// command-buffer compatible).
#include <cuda_runtime_api.h>

#include <cstdint>

#include "cuda/ep_plan.h"
#include "ffi/ep_plan_args.h"
#include "ffi/status.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace moe_xla {
namespace {

using ffi_args::S32Buffer;

ffi::Error ep_dedup_rows_cuda(cudaStream_t stream, S32Buffer dest, S32Buffer lid, ffi::Result<S32Buffer> row_dest,
                              ffi::Result<S32Buffer> lids, ffi::Result<S32Buffer> weight_slot,
                              ffi::Result<S32Buffer> weight_sources, int64_t peers, int64_t local, int64_t mult) {
  auto p = ffi_args::decode_ep_dedup_rows(dest, lid, *row_dest, *lids, *weight_slot, *weight_sources, peers, local,
                                          mult);
  if (p.has_error()) return p.error();
  return ffi_args::to_error(cuda::ep_dedup_rows(*p, stream), "ep_dedup_rows");
}

ffi::Error ep_row_places_cuda(cudaStream_t stream, S32Buffer row_dest, S32Buffer row_map, S32Buffer lids,
                              ffi::Result<S32Buffer> dest_rows, ffi::Result<S32Buffer> row,
                              ffi::Result<S32Buffer> source, ffi::Result<S32Buffer> pairs, int64_t peers,
                              int64_t local, int64_t rows_per_token) {
  auto p = ffi_args::decode_ep_row_places(row_dest, row_map, lids, *dest_rows, *row, *source, *pairs, peers, local,
                                          rows_per_token);
  if (p.has_error()) return p.error();
  return ffi_args::to_error(cuda::ep_row_places(*p, stream), "ep_row_places");
}

}  // namespace
}  // namespace moe_xla

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeXlaEpDedupRowsCudaV2, moe_xla::ep_dedup_rows_cuda,
                              moe_xla::ffi_args::bind_ep_dedup_rows(
                                  ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeXlaEpRowPlacesCuda, moe_xla::ep_row_places_cuda,
                              moe_xla::ffi_args::bind_ep_row_places(
                                  ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});
