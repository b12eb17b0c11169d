// XLA FFI handlers of quantize_fp8_group_cols (the FP8 wgrad operands: 128 x 1 column tiles
// that restart at every group boundary, written transposed), quantize_fp8_rows_group_cols
// (those and the 1 x 128 row tiles of the same x), gather_quantize_fp8_group_cols (both
// of rows gathered from token rows, the column tiles' scaled) and
// activate_quantize_fp8_group_cols (both of the expert activation of h, never written) on
// CUDA: decode, validate and enqueue cuda::fp8_quantize_group_cols on XLA's stream. Group
// sizes and sources stay on the device; no host sync, no scratch: command-buffer compatible.
#include <cuda_runtime_api.h>

#include "cuda/fp8_quantize.h"
#include "ffi/fp8_quantize_args.h"
#include "ffi/status.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace moe_xla {
namespace {

ffi::Error quantize_group_cols_cuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> group_sizes,
                                    ffi::Result<ffi::AnyBuffer> q_t, ffi::ResultBuffer<ffi::F32> scales,
                                    bool pow2_scale) {
  auto p = ffi_args::decode_fp8_group_cols(x, group_sizes, *q_t, *scales, pow2_scale);
  if (p.has_error()) return p.error();
  return ffi_args::to_error(cuda::fp8_quantize_group_cols(*p, stream), "quantize_fp8_group_cols");
}

ffi::Error quantize_rows_group_cols_cuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> group_sizes,
                                         ffi::Result<ffi::AnyBuffer> q, ffi::ResultBuffer<ffi::F32> row_scales,
                                         ffi::Result<ffi::AnyBuffer> q_t, ffi::ResultBuffer<ffi::F32> scales,
                                         bool pow2_scale) {
  auto p = ffi_args::decode_fp8_rows_group_cols(x, group_sizes, *q, *row_scales, *q_t, *scales, pow2_scale);
  if (p.has_error()) return p.error();
  return ffi_args::to_error(cuda::fp8_quantize_group_cols(*p, stream), "quantize_fp8_rows_group_cols");
}

ffi::Error gather_quantize_group_cols_cuda(cudaStream_t stream, ffi::AnyBuffer values, ffi::AnyBuffer sources,
                                           ffi::Buffer<ffi::S32> group_sizes, ffi::RemainingArgs factor,
                                           ffi::Result<ffi::AnyBuffer> q, ffi::ResultBuffer<ffi::F32> row_scales,
                                           ffi::Result<ffi::AnyBuffer> q_t, ffi::ResultBuffer<ffi::F32> scales,
                                           bool pow2_scale) {
  auto p = ffi_args::decode_fp8_gather_group_cols(values, sources, group_sizes, factor, *q, *row_scales, *q_t, *scales,
                                                  pow2_scale);
  if (p.has_error()) return p.error();
  return ffi_args::to_error(cuda::fp8_quantize_group_cols(*p, stream), "gather_quantize_fp8_group_cols");
}

ffi::Error activate_quantize_group_cols_cuda(cudaStream_t stream, ffi::AnyBuffer h, ffi::Buffer<ffi::S32> group_sizes,
                                             ffi::Result<ffi::AnyBuffer> q, ffi::ResultBuffer<ffi::F32> row_scales,
                                             ffi::Result<ffi::AnyBuffer> q_t, ffi::ResultBuffer<ffi::F32> scales,
                                             int32_t activation, bool pow2_scale) {
  auto p = ffi_args::decode_fp8_activate_group_cols(h, group_sizes, *q, *row_scales, *q_t, *scales, activation,
                                                    pow2_scale);
  if (p.has_error()) return p.error();
  return ffi_args::to_error(cuda::fp8_quantize_group_cols(*p, stream), "activate_quantize_fp8_group_cols");
}

}  // namespace
}  // namespace moe_xla

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeXlaQuantizeFp8GroupColsCuda, moe_xla::quantize_group_cols_cuda,
                              moe_xla::ffi_args::bind_fp8_group_cols(
                                  ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeXlaQuantizeFp8RowsGroupColsCuda, moe_xla::quantize_rows_group_cols_cuda,
                              moe_xla::ffi_args::bind_fp8_rows_group_cols(
                                  ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeXlaGatherQuantizeFp8GroupColsCuda, moe_xla::gather_quantize_group_cols_cuda,
                              moe_xla::ffi_args::bind_fp8_gather_group_cols(
                                  ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeXlaActivateQuantizeFp8GroupColsCuda, moe_xla::activate_quantize_group_cols_cuda,
                              moe_xla::ffi_args::bind_fp8_activate_group_cols(
                                  ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});
