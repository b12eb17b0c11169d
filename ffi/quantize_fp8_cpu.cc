// XLA FFI handlers of quantize_fp8_rows (1 x 128 row tiles), quantize_fp8_blocks
// (128 x 128 blocks, with their optional transposed copy q_t) and activate_quantize_fp8
// (the expert activation and its row quantisation) on the host platform.
#include <cstdint>

#include "common/fp8_blockwise.h"
#include "cpu/fp8_quantize.h"
#include "ffi/fp8_quantize_args.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace moe_xla {
namespace {

ffi::Error run(const ffi::ErrorOr<Fp8QuantizeParams>& p) {
  if (p.has_error()) return p.error();
  cpu::fp8_quantize(*p);
  return ffi::Error::Success();
}

ffi::Error quantize_rows(ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> q, ffi::ResultBuffer<ffi::F32> scales,
                         bool pow2_scale) {
  return run(ffi_args::decode_fp8_quantize(x, *q, *scales, 1, pow2_scale));
}

ffi::Error quantize_blocks(ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> q, ffi::ResultBuffer<ffi::F32> scales,
                           ffi::Result<ffi::AnyBuffer> q_t, bool pow2_scale) {
  return run(ffi_args::decode_fp8_quantize(x, *q, *scales, fp8::kTile, pow2_scale, &*q_t));
}

ffi::Error activate_quantize(ffi::AnyBuffer h, ffi::Result<ffi::AnyBuffer> a, ffi::Result<ffi::AnyBuffer> q,
                             ffi::ResultBuffer<ffi::F32> scales, int32_t activation, bool pow2_scale) {
  auto p = ffi_args::decode_fp8_activate_quantize(h, *a, *q, *scales, activation, pow2_scale);
  if (p.has_error()) return p.error();
  cpu::fp8_activate_quantize(*p);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace moe_xla

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeXlaQuantizeFp8RowsCpu, moe_xla::quantize_rows,
                              moe_xla::ffi_args::bind_fp8_quantize<false>(ffi::Ffi::Bind()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeXlaQuantizeFp8BlocksCpu, moe_xla::quantize_blocks,
                              moe_xla::ffi_args::bind_fp8_quantize<true>(ffi::Ffi::Bind()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeXlaActivateQuantizeFp8Cpu, moe_xla::activate_quantize,
                              moe_xla::ffi_args::bind_fp8_activate_quantize(ffi::Ffi::Bind()));
