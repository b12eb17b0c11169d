// XLA FFI handler of gmm_fp8 (the FP8 blockwise grouped product) on the host platform.
#include <cstdint>
#include <functional>
#include <utility>

#include "cpu/fp8_grouped_gemm.h"
#include "ffi/fp8_gemm_args.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace moe_xla {
namespace {

// Output tiles spread over XLA:CPU's intra-op thread pool.
ffi::Error gmm_fp8_cpu(ffi::ThreadPool pool, ffi::AnyBuffer lhs, ffi::Buffer<ffi::F32> lhs_scales, ffi::AnyBuffer rhs,
                       ffi::Buffer<ffi::F32> rhs_scales, ffi::Buffer<ffi::S32> group_sizes,
                       ffi::Result<ffi::AnyBuffer> out, int32_t /*path: CUDA only*/) {
  auto p = ffi_args::decode_fp8_gemm(lhs, lhs_scales, rhs, rhs_scales, group_sizes, *out);
  if (p.has_error()) return p.error();
  cpu::fp8_grouped_gemm(*p, pool.num_threads(), [&pool](std::function<void()> task) { pool.Schedule(std::move(task)); });
  return ffi::Error::Success();
}

}  // namespace
}  // namespace moe_xla

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeXlaGmmFp8Cpu, moe_xla::gmm_fp8_cpu,
                              moe_xla::ffi_args::bind_fp8_gemm(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>()));
