// XLA FFI handlers of quantize_fp8_rows (1 x 128 row tiles), quantize_fp8_blocks
// (128 x 128 blocks), quantize_fp8_weights (the blocks in both layouts, q and q
// transposed, in one kernel), activate_quantize_fp8 (the expert activation and its row
// quantisation), activate_grad_quantize_fp8 (its backward and the row quantisation of
// d h) and expand_quantize_fp8_rows (token rows expanded into the rows of their pairs,
// scaled, and their row quantisation) on CUDA: decode, validate and enqueue
// cuda::fp8_quantize / cuda::fp8_activate_quantize / cuda::fp8_activate_grad_quantize /
// cuda::fp8_expand_quantize on XLA's stream (no host sync, no scratch: the expansion's
// row owners live in a workspace result, ffi/workspace.h; command-buffer compatible).
// One quantisation function, the tile height fixed per symbol.
#include <cuda_runtime_api.h>

#include <cstdint>

#include "common/fp8_blockwise.h"
#include "cuda/fp8_quantize.h"
#include "ffi/fp8_quantize_args.h"
#include "ffi/status.h"
#include "ffi/workspace.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace moe_xla {
namespace {

template <int64_t kTileRows>
ffi::Error quantize_fp8_cuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> q,
                             ffi::ResultBuffer<ffi::F32> scales, bool pow2_scale) {
  auto p = ffi_args::decode_fp8_quantize(x, *q, *scales, kTileRows, pow2_scale);
  if (p.has_error()) return p.error();
  return ffi_args::to_error(cuda::fp8_quantize(*p, stream),
                            kTileRows == 1 ? "quantize_fp8_rows" : "quantize_fp8_blocks");
}

ffi::Error quantize_weights(cudaStream_t stream, ffi::AnyBuffer w, ffi::Result<ffi::AnyBuffer> q,
                            ffi::Result<ffi::AnyBuffer> q_t, ffi::ResultBuffer<ffi::F32> scales, bool pow2_scale) {
  auto p = ffi_args::decode_fp8_quantize(w, *q, *scales, fp8::kTile, pow2_scale, &*q_t);
  if (p.has_error()) return p.error();
  return ffi_args::to_error(cuda::fp8_quantize(*p, stream), "quantize_fp8_weights");
}

ffi::Error activate_quantize(cudaStream_t stream, ffi::AnyBuffer h, ffi::Result<ffi::AnyBuffer> a,
                             ffi::Result<ffi::AnyBuffer> q, ffi::ResultBuffer<ffi::F32> scales, int32_t activation,
                             bool pow2_scale) {
  auto p = ffi_args::decode_fp8_activate_quantize(h, *a, *q, *scales, activation, pow2_scale);
  if (p.has_error()) return p.error();
  return ffi_args::to_error(cuda::fp8_activate_quantize(*p, stream), "activate_quantize_fp8");
}

ffi::Error activate_grad_quantize(cudaStream_t stream, ffi::AnyBuffer h, ffi::AnyBuffer g,
                                  ffi::Buffer<ffi::F32> omega, ffi::Result<ffi::AnyBuffer> dh,
                                  ffi::Result<ffi::AnyBuffer> q, ffi::ResultBuffer<ffi::F32> scales,
                                  ffi::ResultBuffer<ffi::F32> d_omega_tiles, int32_t activation, bool pow2_scale) {
  auto p = ffi_args::decode_fp8_activate_grad_quantize(h, g, omega, *dh, *q, *scales, *d_omega_tiles, activation,
                                                       pow2_scale);
  if (p.has_error()) return p.error();
  return ffi_args::to_error(cuda::fp8_activate_grad_quantize(*p, stream), "activate_grad_quantize_fp8");
}

ffi::Error expand_quantize(cudaStream_t stream, ffi::AnyBuffer values, ffi::AnyBuffer slots,
                           ffi::RemainingArgs factor, ffi::Result<ffi::AnyBuffer> rows, ffi::Result<ffi::AnyBuffer> q,
                           ffi::ResultBuffer<ffi::F32> scales, ffi::Result<ffi::AnyBuffer> workspace_buffer,
                           bool pow2_scale) {
  auto p = ffi_args::decode_fp8_expand_quantize(values, slots, factor, *rows, *q, *scales, pow2_scale);
  if (p.has_error()) return p.error();
  const char* op = "expand_quantize_fp8_rows";
  auto workspace = ffi_args::workspace(*workspace_buffer, cuda::fp8_expand_workspace_bytes(*p), op);
  if (workspace.has_error()) return workspace.error();
  return ffi_args::to_error(cuda::fp8_expand_quantize(*p, *workspace, stream), op);
}

}  // namespace
}  // namespace moe_xla

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeXlaQuantizeFp8RowsCuda, moe_xla::quantize_fp8_cuda<1>,
                              moe_xla::ffi_args::bind_fp8_quantize(
                                  ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeXlaQuantizeFp8BlocksCuda, moe_xla::quantize_fp8_cuda<moe_xla::fp8::kTile>,
                              moe_xla::ffi_args::bind_fp8_quantize(
                                  ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeXlaQuantizeFp8WeightsCuda, moe_xla::quantize_weights,
                              moe_xla::ffi_args::bind_fp8_weight_layouts(
                                  ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeXlaActivateQuantizeFp8Cuda, moe_xla::activate_quantize,
                              moe_xla::ffi_args::bind_fp8_activate_quantize(
                                  ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeXlaActivateGradQuantizeFp8Cuda, moe_xla::activate_grad_quantize,
                              moe_xla::ffi_args::bind_fp8_activate_grad_quantize(
                                  ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeXlaExpandQuantizeFp8RowsCudaV2, moe_xla::expand_quantize,
                              moe_xla::ffi_args::bind_fp8_expand_quantize(
                                  ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>())
                                  .Ret<ffi::AnyBuffer>()  // workspace u8[MoeXlaExpandQuantizeFp8RowsWorkspaceBytes(R, T*k)]
                                  .Attr<bool>("pow2_scale"),
                              {ffi::Traits::kCmdBufferCompatible});

// Workspace bytes of an expand_quantize_fp8_rows call of `rows` rows and `pairs` (T*k)
// pairs, any width and dtype (called from Python through ctypes when lowering).
extern "C" int64_t MoeXlaExpandQuantizeFp8RowsWorkspaceBytes(int64_t rows, int64_t pairs) {
  return static_cast<int64_t>(moe_xla::cuda::fp8_expand_workspace_bytes(rows, pairs));
}
