// XLA FFI handlers of quantize_fp8_rows (1 x 128 row tiles), quantize_fp8_blocks
// (128 x 128 blocks), quantize_fp8_weights (the blocks in both layouts, q and q
// transposed), quantize_fp8_group_cols (the wgrad's 128 x 1 column tiles per group,
// transposed), quantize_fp8_rows_group_cols (those and the row tiles of the same x),
// activate_quantize_fp8 (the expert activation and its row quantisation),
// activate_grad_quantize_fp8 (its backward and the row quantisation of d h),
// expand_quantize_fp8_rows (token rows expanded into the rows of their pairs, scaled, and
// their row quantisation), gather_quantize_fp8_group_cols (both tilings of rows
// gathered from token rows, the column tiles' scaled) and activate_quantize_fp8_group_cols
// (both tilings of the expert activation) on the host platform. One
// quantisation function for rows, blocks and weights, the tile height fixed per symbol.
#include <cstdint>

#include "common/fp8_blockwise.h"
#include "cpu/fp8_quantize.h"
#include "ffi/fp8_quantize_args.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace moe_xla {
namespace {

template <int64_t kTileRows>
ffi::Error quantize_fp8_cpu(ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> q, ffi::ResultBuffer<ffi::F32> scales,
                            bool pow2_scale) {
  auto p = ffi_args::decode_fp8_quantize(x, *q, *scales, kTileRows, pow2_scale);
  if (p.has_error()) return p.error();
  cpu::fp8_quantize(*p);
  return ffi::Error::Success();
}

ffi::Error quantize_weights(ffi::AnyBuffer w, ffi::Result<ffi::AnyBuffer> q, ffi::Result<ffi::AnyBuffer> q_t,
                            ffi::ResultBuffer<ffi::F32> scales, bool pow2_scale) {
  auto p = ffi_args::decode_fp8_quantize(w, *q, *scales, fp8::kTile, pow2_scale, &*q_t);
  if (p.has_error()) return p.error();
  cpu::fp8_quantize(*p);
  return ffi::Error::Success();
}

ffi::Error quantize_group_cols(ffi::AnyBuffer x, ffi::Buffer<ffi::S32> group_sizes, ffi::Result<ffi::AnyBuffer> q_t,
                               ffi::ResultBuffer<ffi::F32> scales, bool pow2_scale) {
  auto p = ffi_args::decode_fp8_group_cols(x, group_sizes, *q_t, *scales, pow2_scale);
  if (p.has_error()) return p.error();
  cpu::fp8_quantize_group_cols(*p);
  return ffi::Error::Success();
}

ffi::Error quantize_rows_group_cols(ffi::AnyBuffer x, ffi::Buffer<ffi::S32> group_sizes, ffi::Result<ffi::AnyBuffer> q,
                                    ffi::ResultBuffer<ffi::F32> row_scales, ffi::Result<ffi::AnyBuffer> q_t,
                                    ffi::ResultBuffer<ffi::F32> scales, bool pow2_scale) {
  auto p = ffi_args::decode_fp8_rows_group_cols(x, group_sizes, *q, *row_scales, *q_t, *scales, pow2_scale);
  if (p.has_error()) return p.error();
  cpu::fp8_quantize_group_cols(*p);
  return ffi::Error::Success();
}

ffi::Error activate_quantize(ffi::AnyBuffer h, ffi::Result<ffi::AnyBuffer> a, ffi::Result<ffi::AnyBuffer> q,
                             ffi::ResultBuffer<ffi::F32> scales, int32_t activation, bool pow2_scale) {
  auto p = ffi_args::decode_fp8_activate_quantize(h, *a, *q, *scales, activation, pow2_scale);
  if (p.has_error()) return p.error();
  cpu::fp8_activate_quantize(*p);
  return ffi::Error::Success();
}

ffi::Error activate_grad_quantize(ffi::AnyBuffer h, ffi::AnyBuffer g, ffi::Buffer<ffi::F32> omega,
                                  ffi::Result<ffi::AnyBuffer> dh, ffi::Result<ffi::AnyBuffer> q,
                                  ffi::ResultBuffer<ffi::F32> scales, ffi::ResultBuffer<ffi::F32> d_omega_tiles,
                                  int32_t activation, bool pow2_scale) {
  auto p = ffi_args::decode_fp8_activate_grad_quantize(h, g, omega, *dh, *q, *scales, *d_omega_tiles, activation,
                                                       pow2_scale);
  if (p.has_error()) return p.error();
  cpu::fp8_activate_grad_quantize(*p);
  return ffi::Error::Success();
}

ffi::Error expand_quantize(ffi::AnyBuffer values, ffi::AnyBuffer slots, ffi::RemainingArgs factor,
                           ffi::Result<ffi::AnyBuffer> rows, ffi::Result<ffi::AnyBuffer> q,
                           ffi::ResultBuffer<ffi::F32> scales, bool pow2_scale) {
  auto p = ffi_args::decode_fp8_expand_quantize(values, slots, factor, *rows, *q, *scales, pow2_scale);
  if (p.has_error()) return p.error();
  cpu::fp8_expand_quantize(*p);
  return ffi::Error::Success();
}

ffi::Error gather_quantize_group_cols(ffi::AnyBuffer values, ffi::AnyBuffer sources, ffi::Buffer<ffi::S32> group_sizes,
                                      ffi::RemainingArgs factor, ffi::Result<ffi::AnyBuffer> q,
                                      ffi::ResultBuffer<ffi::F32> row_scales, ffi::Result<ffi::AnyBuffer> q_t,
                                      ffi::ResultBuffer<ffi::F32> scales, bool pow2_scale) {
  auto p = ffi_args::decode_fp8_gather_group_cols(values, sources, group_sizes, factor, *q, *row_scales, *q_t, *scales,
                                                  pow2_scale);
  if (p.has_error()) return p.error();
  cpu::fp8_quantize_group_cols(*p);
  return ffi::Error::Success();
}

ffi::Error activate_quantize_group_cols(ffi::AnyBuffer h, ffi::Buffer<ffi::S32> group_sizes,
                                        ffi::Result<ffi::AnyBuffer> q, ffi::ResultBuffer<ffi::F32> row_scales,
                                        ffi::Result<ffi::AnyBuffer> q_t, ffi::ResultBuffer<ffi::F32> scales,
                                        int32_t activation, bool pow2_scale) {
  auto p = ffi_args::decode_fp8_activate_group_cols(h, group_sizes, *q, *row_scales, *q_t, *scales, activation,
                                                    pow2_scale);
  if (p.has_error()) return p.error();
  cpu::fp8_quantize_group_cols(*p);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace moe_xla

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeXlaQuantizeFp8RowsCpu, moe_xla::quantize_fp8_cpu<1>,
                              moe_xla::ffi_args::bind_fp8_quantize(ffi::Ffi::Bind()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeXlaQuantizeFp8BlocksCpu, moe_xla::quantize_fp8_cpu<moe_xla::fp8::kTile>,
                              moe_xla::ffi_args::bind_fp8_quantize(ffi::Ffi::Bind()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeXlaQuantizeFp8WeightsCpu, moe_xla::quantize_weights,
                              moe_xla::ffi_args::bind_fp8_weight_layouts(ffi::Ffi::Bind()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeXlaActivateQuantizeFp8Cpu, moe_xla::activate_quantize,
                              moe_xla::ffi_args::bind_fp8_activate_quantize(ffi::Ffi::Bind()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeXlaQuantizeFp8GroupColsCpu, moe_xla::quantize_group_cols,
                              moe_xla::ffi_args::bind_fp8_group_cols(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeXlaQuantizeFp8RowsGroupColsCpu, moe_xla::quantize_rows_group_cols,
                              moe_xla::ffi_args::bind_fp8_rows_group_cols(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeXlaGatherQuantizeFp8GroupColsCpu, moe_xla::gather_quantize_group_cols,
                              moe_xla::ffi_args::bind_fp8_gather_group_cols(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeXlaActivateQuantizeFp8GroupColsCpu, moe_xla::activate_quantize_group_cols,
                              moe_xla::ffi_args::bind_fp8_activate_group_cols(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeXlaActivateGradQuantizeFp8Cpu, moe_xla::activate_grad_quantize,
                              moe_xla::ffi_args::bind_fp8_activate_grad_quantize(ffi::Ffi::Bind()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeXlaExpandQuantizeFp8RowsCpuV2, moe_xla::expand_quantize,
                              moe_xla::ffi_args::bind_fp8_expand_quantize(ffi::Ffi::Bind())
                                  .Attr<bool>("pow2_scale"));
