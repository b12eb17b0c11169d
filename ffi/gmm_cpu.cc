// XLA FFI handlers of gmm and tgmm on the host platform.
#include <functional>
#include <utility>

#include "cpu/grouped_gemm.h"
#include "ffi/grouped_gemm_args.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace moe_xla {
namespace {

// Output tiles spread over XLA:CPU's intra-op thread pool (the threads XLA's own dots use).
ffi::Error run(ffi::ErrorOr<GroupedGemmParams> params, ffi::ThreadPool pool) {
  if (params.has_error()) return params.error();
  cpu::grouped_gemm(*params, pool.num_threads(),
                    [&pool](std::function<void()> task) { pool.Schedule(std::move(task)); });
  return ffi::Error::Success();
}

ffi::Error gmm_cpu(ffi::ThreadPool pool, ffi::AnyBuffer lhs, ffi::AnyBuffer rhs, ffi::Buffer<ffi::S32> group_sizes,
                   ffi::Result<ffi::AnyBuffer> out, bool transpose_rhs) {
  return run(ffi_args::decode(ffi_args::gmm_layout(transpose_rhs), lhs, rhs, group_sizes, *out), pool);
}

ffi::Error tgmm_cpu(ffi::ThreadPool pool, ffi::AnyBuffer lhs, ffi::AnyBuffer rhs, ffi::Buffer<ffi::S32> group_sizes,
                    ffi::Result<ffi::AnyBuffer> out) {
  return run(ffi_args::decode(GroupedLayout::kTgmm, lhs, rhs, group_sizes, *out), pool);
}

}  // namespace
}  // namespace moe_xla

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeXlaGmmCpu, moe_xla::gmm_cpu,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()         // lhs [M, K]
                                  .Arg<ffi::AnyBuffer>()         // rhs [G, K, N] or [G, N, K]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // group_sizes [G]
                                  .Ret<ffi::AnyBuffer>()         // out [M, N]
                                  .Attr<bool>("transpose_rhs"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeXlaTgmmCpu, moe_xla::tgmm_cpu,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()         // lhs [M, K]
                                  .Arg<ffi::AnyBuffer>()         // rhs [M, N]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // group_sizes [G]
                                  .Ret<ffi::AnyBuffer>());       // out [G, K, N]
