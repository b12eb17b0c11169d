// XLA FFI handler of permute (dispatch) on the host platform.
#include "cpu/permute.h"
#include "ffi/routing_args.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace moe_xla {
namespace {

ffi::Error permute_cpu(ffi::AnyBuffer x, ffi::Buffer<ffi::S32> expert_ids, ffi::Result<ffi::AnyBuffer> x_sorted,
                       ffi::ResultBuffer<ffi::S32> group_sizes, ffi::ResultBuffer<ffi::S32> row_map,
                       ffi::ResultBuffer<ffi::S32> row_pairs) {
  auto p = ffi_args::decode_permute(x, expert_ids, *x_sorted, *group_sizes, *row_map, *row_pairs);
  if (p.has_error()) return p.error();
  cpu::permute(*p);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace moe_xla

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeXlaPermuteCpuV2, moe_xla::permute_cpu,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()          // x [T, H]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // expert_ids [T, k]
                                  .Ret<ffi::AnyBuffer>()          // x_sorted [T*k, H]
                                  .Ret<ffi::Buffer<ffi::S32>>()   // group_sizes [E]
                                  .Ret<ffi::Buffer<ffi::S32>>()   // row_map [T*k]
                                  .Ret<ffi::Buffer<ffi::S32>>()); // row_pairs [T*k]
