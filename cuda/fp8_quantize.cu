// CUDA FP8 blockwise quantisation (common/fp8_blockwise.h), one pass over x.
//
// Each lane owns 4 consecutive columns of a 128-wide tile (32 lanes x 4 = 128), loaded
// with one 16-byte (f32) or 8-byte (bf16, f16) access when the columns and the pointers
// allow it, element by element otherwise (tails, odd widths):
//   1 x 128 row tiles:   one warp per tile, 8 tiles per block; amax by warp shuffles.
//   128 x 128 blocks:    one block of 16 warps per tile, 8 rows per warp; amax by warp
//                        shuffles, then across the 16 warps in shared memory.
// A lane keeps its elements in registers as loaded (converted to float where used) from
// the amax to the quantisation, so x is read once. Scale and elements go through common/fp8_blockwise.h, like the CPU kernel; max is
// exact whatever the reduction order, so the results are bitwise those of the CPU.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "common/fp8_blockwise.h"
#include "common/status.h"
#include "cuda/device.h"
#include "cuda/fp8_quantize.h"

namespace moe_xla {
namespace cuda {
namespace {

constexpr int kWarp = 32;
constexpr int kPerLane = fp8::kTile / kWarp;  // 4 columns per lane

// Warps per block: 8 row tiles, or the 16 warps of one 128 x 128 block (8 rows each).
template <int kTileRows>
constexpr int kBlockWarps = kTileRows == 1 ? 8 : 16;

template <DType D>
struct Elem;
template <>
struct Elem<DType::kF32> {
  using Bits = uint32_t;
  static __device__ __forceinline__ float to_float(uint32_t b) { return __uint_as_float(b); }
};
template <>
struct Elem<DType::kBF16> {
  using Bits = uint16_t;
  static __device__ __forceinline__ float to_float(uint16_t b) { return __uint_as_float(uint32_t{b} << 16); }
};
template <>
struct Elem<DType::kF16> {
  using Bits = uint16_t;
  static __device__ __forceinline__ float to_float(uint16_t b) { return __half2float(__ushort_as_half(b)); }
};

// A lane's 4 elements as one aligned access.
template <typename T>
struct alignas(kPerLane * sizeof(T)) Quad {
  T v[kPerLane];
};

// kTileRows 1 or 128; kVector: cols % 4 == 0 and x, q aligned for Quad accesses.
template <DType D, int kTileRows, bool kVector>
__global__ void __launch_bounds__(kWarp * kBlockWarps<kTileRows>)
    quantize_tiles(const typename Elem<D>::Bits* __restrict__ x, uint8_t* __restrict__ q,
                   float* __restrict__ scales, int64_t rows, int64_t cols, int64_t row_tiles,
                   int64_t col_tiles, int64_t num_tiles, bool pow2) {
  using Bits = typename Elem<D>::Bits;
  constexpr int kWarps = kBlockWarps<kTileRows>;
  constexpr int kWarpsPerTile = kTileRows == 1 ? 1 : kWarps;
  constexpr int kRowsPerWarp = kTileRows / kWarpsPerTile;
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int64_t tile = static_cast<int64_t>(blockIdx.x) * (kWarps / kWarpsPerTile) + warp / kWarpsPerTile;
  if (tile >= num_tiles) return;  // whole blocks for kTileRows 128 (one tile per block)
  const int64_t ct = tile % col_tiles, batch_row_tile = tile / col_tiles;
  const int64_t b = batch_row_tile / row_tiles, rt = batch_row_tile % row_tiles;
  const int64_t c = ct * fp8::kTile + lane * kPerLane;
  const int valid = static_cast<int>(cols - c < 0 ? 0 : (cols - c < kPerLane ? cols - c : kPerLane));
  const int64_t first_row = rt * kTileRows + warp % kWarpsPerTile;

  Quad<Bits> raw[kRowsPerWarp];  // the tile's elements as loaded (zero bits outside x)
  float amax = 0.0f;
#pragma unroll
  for (int i = 0; i < kRowsPerWarp; ++i) {
    const int64_t r = first_row + static_cast<int64_t>(i) * kWarpsPerTile;
    const int64_t base = (b * rows + r) * cols + c;
    if constexpr (kVector) {
      raw[i] = (r < rows && valid == kPerLane) ? *reinterpret_cast<const Quad<Bits>*>(x + base) : Quad<Bits>{};
    } else {
#pragma unroll
      for (int j = 0; j < kPerLane; ++j) raw[i].v[j] = (r < rows && j < valid) ? x[base + j] : Bits{0};
    }
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) amax = fmaxf(amax, fp8::tile_magnitude(Elem<D>::to_float(raw[i].v[j])));
  }
#pragma unroll
  for (int offset = kWarp / 2; offset > 0; offset /= 2) {
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
  }
  if constexpr (kWarpsPerTile > 1) {
    __shared__ float warp_amax[kWarps];
    if (lane == 0) warp_amax[warp] = amax;
    __syncthreads();
#pragma unroll
    for (int w = 0; w < kWarps; ++w) amax = fmaxf(amax, warp_amax[w]);
  }
  const float scale = fp8::scale_from_amax(amax, pow2);
  if (threadIdx.x % (kWarp * kWarpsPerTile) == 0) scales[tile] = scale;

#pragma unroll
  for (int i = 0; i < kRowsPerWarp; ++i) {
    const int64_t r = first_row + static_cast<int64_t>(i) * kWarpsPerTile;
    if (r >= rows || valid == 0) continue;
    const int64_t base = (b * rows + r) * cols + c;
    Quad<uint8_t> out;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) out.v[j] = fp8::quantize_element(Elem<D>::to_float(raw[i].v[j]), scale);
    if constexpr (kVector) {
      *reinterpret_cast<Quad<uint8_t>*>(q + base) = out;
    } else {
      for (int j = 0; j < valid; ++j) q[base + j] = out.v[j];
    }
  }
}

template <DType D, int kTileRows>
cudaError_t launch(const Fp8QuantizeParams& p, int64_t num_tiles, cudaStream_t stream) {
  using Bits = typename Elem<D>::Bits;
  const int64_t row_tiles = (p.rows + kTileRows - 1) / kTileRows, col_tiles = fp8::tiles(p.cols);
  constexpr int kThreads = kWarp * kBlockWarps<kTileRows>;
  const int64_t tiles_per_block = kTileRows == 1 ? kBlockWarps<kTileRows> : 1;
  const int64_t blocks = (num_tiles + tiles_per_block - 1) / tiles_per_block;
  if (blocks > 0x7fffffff) return cudaErrorInvalidConfiguration;
  const bool vector = p.cols % kPerLane == 0 && reinterpret_cast<uintptr_t>(p.x) % sizeof(Quad<Bits>) == 0 &&
                      reinterpret_cast<uintptr_t>(p.q) % sizeof(Quad<uint8_t>) == 0;
  const auto* x = static_cast<const Bits*>(p.x);
  const dim3 grid(static_cast<unsigned>(blocks));
  if (vector) {
    quantize_tiles<D, kTileRows, true><<<grid, kThreads, 0, stream>>>(x, p.q, p.scales, p.rows, p.cols, row_tiles,
                                                                       col_tiles, num_tiles, p.pow2_scale);
  } else {
    quantize_tiles<D, kTileRows, false><<<grid, kThreads, 0, stream>>>(x, p.q, p.scales, p.rows, p.cols, row_tiles,
                                                                        col_tiles, num_tiles, p.pow2_scale);
  }
  return cudaGetLastError();
}

template <DType D>
cudaError_t dispatch(const Fp8QuantizeParams& p, int64_t num_tiles, cudaStream_t stream) {
  return p.tile_rows == 1 ? launch<D, 1>(p, num_tiles, stream) : launch<D, fp8::kTile>(p, num_tiles, stream);
}

}  // namespace

Status fp8_quantize(const Fp8QuantizeParams& p, cudaStream_t stream) {
  MOE_XLA_RETURN_IF_ERROR(require_device(DeviceSupport::kSimt, "fp8 quantize"));
  if (p.batch < 0 || p.rows < 0 || p.cols < 0) return Status::InvalidArgument("fp8 quantize: negative dimension");
  if (p.tile_rows != 1 && p.tile_rows != fp8::kTile) {
    return Status::InvalidArgument("fp8 quantize: tile_rows must be 1 or 128, got " + std::to_string(p.tile_rows));
  }
  const int64_t num_tiles = p.batch * ((p.rows + p.tile_rows - 1) / p.tile_rows) * fp8::tiles(p.cols);
  if (num_tiles == 0) return Status();
  switch (p.dtype) {
    case DType::kF32: MOE_XLA_RETURN_IF_CUDA_ERROR(dispatch<DType::kF32>(p, num_tiles, stream)); break;
    case DType::kBF16: MOE_XLA_RETURN_IF_CUDA_ERROR(dispatch<DType::kBF16>(p, num_tiles, stream)); break;
    case DType::kF16: MOE_XLA_RETURN_IF_CUDA_ERROR(dispatch<DType::kF16>(p, num_tiles, stream)); break;
    default: return Status::InvalidArgument("fp8 quantize: unsupported dtype");
  }
  return Status();
}

}  // namespace cuda
}  // namespace moe_xla
