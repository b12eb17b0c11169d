// XLA FFI handler of tgmm_fp8 (the FP8 wgrad of operands quantised in group column tiles)
// on the host platform.
#include <cstdint>
#include <functional>
#include <utility>

#include "cpu/fp8_wgrad.h"
#include "ffi/fp8_gemm_args.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace moe_xla {
namespace {

// Output blocks spread over XLA:CPU's intra-op thread pool.
ffi::Error tgmm_fp8_cpu(ffi::ThreadPool pool, ffi::AnyBuffer lhs_t, ffi::Buffer<ffi::F32> lhs_scales,
                        ffi::AnyBuffer rhs_t, ffi::Buffer<ffi::F32> rhs_scales, ffi::Buffer<ffi::S32> group_sizes,
                        ffi::Result<ffi::AnyBuffer> out, int64_t rows, int32_t /*path: CUDA only*/) {
  auto p = ffi_args::decode_fp8_wgrad(lhs_t, lhs_scales, rhs_t, rhs_scales, group_sizes, *out, rows);
  if (p.has_error()) return p.error();
  cpu::fp8_wgrad(*p, pool.num_threads(), [&pool](std::function<void()> task) { pool.Schedule(std::move(task)); });
  return ffi::Error::Success();
}

}  // namespace
}  // namespace moe_xla

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeXlaTgmmFp8Cpu, moe_xla::tgmm_fp8_cpu,
                              moe_xla::ffi_args::bind_fp8_wgrad(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>()));
