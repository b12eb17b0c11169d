// Decodes and validates the buffers and attributes of the ep_dedup_rows and ep_row_places
// FFI calls into the framework-free params of common/ep_plan.h, for both the CPU and the
// CUDA handlers, and binds their operands. Every error names the argument, what was
// expected and what was passed.
#ifndef MOE_XLA_FFI_EP_PLAN_ARGS_H_
#define MOE_XLA_FFI_EP_PLAN_ARGS_H_

#include <cstdint>
#include <limits>
#include <string>
#include <utility>

#include "common/ep_plan.h"
#include "ffi/grouped_gemm_args.h"  // shape_string, invalid, expect_shape
#include "xla/ffi/api/ffi.h"

namespace moe_xla::ffi_args {

namespace ffi = xla::ffi;

using S32Buffer = ffi::Buffer<ffi::S32>;

// The plan's sizes: T and k from a [T, k] operand, and the attributes both ops take.
inline ffi::ErrorOr<EpPlanDims> plan_dims(const char* what, S32Buffer pairs, int64_t peers, int64_t local,
                                          int64_t mult, int64_t rows_per_token) {
  const auto dims = pairs.dimensions();
  if (dims.size() != 2) return invalid(std::string(what) + ": expected rank 2 [T, k], got shape " + shape_string(dims));
  constexpr int64_t kMax = std::numeric_limits<int32_t>::max();
  const int64_t T = dims[0], k = dims[1];
  if (peers < 1 || peers >= kMax) return invalid("peers: expected 1 <= peers < 2^31 - 1, got " + std::to_string(peers));
  if (local < 0 || local > kMax) return invalid("local: expected 0 <= local < 2^31, got " + std::to_string(local));
  if (mult < 1) return invalid("mult: expected at least 1, got " + std::to_string(mult));
  if (rows_per_token < 0 || rows_per_token > k) {
    return invalid("rows_per_token: expected 0 <= n <= k = " + std::to_string(k) + ", got " +
                   std::to_string(rows_per_token));
  }
  if (T * k > kMax || T * rows_per_token * mult > kMax) {
    return invalid(std::string(what) + ": T * k = " + std::to_string(T * k) + " and T * n * mult = " +
                   std::to_string(T * rows_per_token * mult) + " must fit in int32");
  }
  return EpPlanDims{T, k, static_cast<int32_t>(peers), static_cast<int32_t>(local), mult, rows_per_token};
}

inline ffi::Unexpected<ffi::Error> failed(ffi::Error e) { return ffi::Unexpected<ffi::Error>(std::move(e)); }

// ep_dedup_rows: dest, lid [T, k]; row_dest [T, k], lids [T*n, mult], weight_slot [T*k],
// weight_sources [T*n*mult], n = min(k, peers).
inline ffi::ErrorOr<EpDedupRowsParams> decode_ep_dedup_rows(S32Buffer dest, S32Buffer lid, S32Buffer row_dest,
                                                            S32Buffer lids, S32Buffer weight_slot,
                                                            S32Buffer weight_sources, int64_t peers, int64_t local,
                                                            int64_t mult) {
  const int64_t k = dest.dimensions().size() == 2 ? dest.dimensions()[1] : 0;
  const int64_t n = k < peers ? k : peers;
  auto dims = plan_dims("dest", dest, peers, local, mult, n);
  if (dims.has_error()) return failed(dims.error());
  const int64_t T = dims->tokens;
  if (auto e = expect_shape("lid", lid.dimensions(), {T, k}); e.failure()) return failed(e);
  if (auto e = expect_shape("row_dest", row_dest.dimensions(), {T, k}); e.failure()) return failed(e);
  if (auto e = expect_shape("lids", lids.dimensions(), {T * n, mult}); e.failure()) return failed(e);
  if (auto e = expect_shape("weight_slot", weight_slot.dimensions(), {T * k}); e.failure()) return failed(e);
  if (auto e = expect_shape("weight_sources", weight_sources.dimensions(), {T * n * mult}); e.failure()) {
    return failed(e);
  }
  EpDedupRowsParams p{};
  p.dest = dest.typed_data();
  p.lid = lid.typed_data();
  p.row_dest = row_dest.typed_data();
  p.lids = lids.typed_data();
  p.weight_slot = weight_slot.typed_data();
  p.weight_sources = weight_sources.typed_data();
  p.dims = *dims;
  return p;
}

// ep_row_places: row_dest [T, k], row_map [T*k], lids [T*n, mult]; dest_rows, row [T, n],
// source, pairs [T*k].
inline ffi::ErrorOr<EpRowPlacesParams> decode_ep_row_places(S32Buffer row_dest, S32Buffer row_map, S32Buffer lids,
                                                            S32Buffer dest_rows, S32Buffer row, S32Buffer source,
                                                            S32Buffer pairs, int64_t peers, int64_t local,
                                                            int64_t rows_per_token) {
  const auto lid_dims = lids.dimensions();
  if (lid_dims.size() != 2) return invalid("lids: expected rank 2 [T*n, mult], got shape " + shape_string(lid_dims));
  const int64_t mult = lid_dims[1], n = rows_per_token;
  auto dims = plan_dims("row_dest", row_dest, peers, local, mult, n);
  if (dims.has_error()) return failed(dims.error());
  const int64_t T = dims->tokens, k = dims->top_k;
  if (auto e = expect_shape("row_map", row_map.dimensions(), {T * k}); e.failure()) return failed(e);
  if (auto e = expect_shape("lids", lid_dims, {T * n, mult}); e.failure()) return failed(e);
  if (auto e = expect_shape("dest_rows", dest_rows.dimensions(), {T, n}); e.failure()) return failed(e);
  if (auto e = expect_shape("row", row.dimensions(), {T, n}); e.failure()) return failed(e);
  if (auto e = expect_shape("source", source.dimensions(), {T * k}); e.failure()) return failed(e);
  if (auto e = expect_shape("pairs", pairs.dimensions(), {T * k}); e.failure()) return failed(e);
  EpRowPlacesParams p{};
  p.row_dest = row_dest.typed_data();
  p.row_map = row_map.typed_data();
  p.lids = lids.typed_data();
  p.dest_rows = dest_rows.typed_data();
  p.row = row.typed_data();
  p.source = source.typed_data();
  p.pairs = pairs.typed_data();
  p.dims = *dims;
  return p;
}

// The operands and attributes of the ep_dedup_rows handlers, appended to `binding` (the
// CUDA handler binds its stream first), in decode_ep_dedup_rows' order.
template <class Binding>
auto bind_ep_dedup_rows(Binding&& binding) {
  return std::move(binding)
      .template Arg<S32Buffer>()   // dest [T, k]
      .template Arg<S32Buffer>()   // lid [T, k]
      .template Ret<S32Buffer>()   // row_dest [T, k]
      .template Ret<S32Buffer>()   // lids [T*n, mult]
      .template Ret<S32Buffer>()   // weight_slot [T*k]
      .template Ret<S32Buffer>()   // weight_sources [T*n*mult]
      .template Attr<int64_t>("peers")
      .template Attr<int64_t>("local")
      .template Attr<int64_t>("mult");
}

// The same for ep_row_places, in decode_ep_row_places' order.
template <class Binding>
auto bind_ep_row_places(Binding&& binding) {
  return std::move(binding)
      .template Arg<S32Buffer>()   // row_dest [T, k]
      .template Arg<S32Buffer>()   // row_map [T*k]
      .template Arg<S32Buffer>()   // lids [T*n, mult]
      .template Ret<S32Buffer>()   // dest_rows [T, n]
      .template Ret<S32Buffer>()   // row [T, n]
      .template Ret<S32Buffer>()   // source [T*k]
      .template Ret<S32Buffer>()   // pairs [T*k]
      .template Attr<int64_t>("peers")
      .template Attr<int64_t>("local")
      .template Attr<int64_t>("rows_per_token");
}

}  // namespace moe_xla::ffi_args

#endif  // MOE_XLA_FFI_EP_PLAN_ARGS_H_
