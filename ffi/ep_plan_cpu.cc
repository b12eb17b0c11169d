// XLA FFI handlers of the EP dispatch plan (ep_dedup_rows, ep_row_places) on the host
// platform.
#include <cstdint>

#include "cpu/ep_plan.h"
#include "ffi/ep_plan_args.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace moe_xla {
namespace {

using ffi_args::S32Buffer;

ffi::Error ep_dedup_rows_cpu(S32Buffer dest, S32Buffer lid, ffi::Result<S32Buffer> row_dest,
                             ffi::Result<S32Buffer> lids, ffi::Result<S32Buffer> weight_slot,
                             ffi::Result<S32Buffer> weight_sources, int64_t peers, int64_t local, int64_t mult) {
  auto p = ffi_args::decode_ep_dedup_rows(dest, lid, *row_dest, *lids, *weight_slot, *weight_sources, peers, local,
                                          mult);
  if (p.has_error()) return p.error();
  cpu::ep_dedup_rows(*p);
  return ffi::Error::Success();
}

ffi::Error ep_row_places_cpu(S32Buffer row_dest, S32Buffer row_map, S32Buffer lids, ffi::Result<S32Buffer> dest_rows,
                             ffi::Result<S32Buffer> row, ffi::Result<S32Buffer> source,
                             ffi::Result<S32Buffer> pairs, int64_t peers, int64_t local, int64_t rows_per_token) {
  auto p = ffi_args::decode_ep_row_places(row_dest, row_map, lids, *dest_rows, *row, *source, *pairs, peers, local,
                                          rows_per_token);
  if (p.has_error()) return p.error();
  cpu::ep_row_places(*p);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace moe_xla

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeXlaEpDedupRowsCpuV2, moe_xla::ep_dedup_rows_cpu,
                              moe_xla::ffi_args::bind_ep_dedup_rows(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeXlaEpRowPlacesCpu, moe_xla::ep_row_places_cpu,
                              moe_xla::ffi_args::bind_ep_row_places(ffi::Ffi::Bind()));
