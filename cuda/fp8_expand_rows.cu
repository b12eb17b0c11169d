// CUDA expand_quantize_fp8_rows (Fp8ExpandQuantizeParams in common/fp8_blockwise.h): the
// token rows expanded into the rows of their (token, expert) pairs, scaled, and the
// 1 x 128 row quantisation of the unscaled token rows, each token row read and quantised once.
//
// Three steps on the stream, with the row owners and each pair's destination in the
// workspace:
//   claim:  owner[r] = the largest pair naming row r (memset to -1, then atomicMax: the
//           result does not depend on the order of the atomics);
//   settle: dest[p] = slots[p] where pair p owns its row, else -1; rows no pair names
//           become zero rows (q 0, the scale of a zero tile), one thread per row;
//   expand: a CTA covers kRegionTokens token rows x 128 columns; a thread loads 8 columns
//           of kTokens token rows once and quantises each token row's unscaled tile,
//           rnd(scaled_element(1, x)), once (the 16 threads of the row are a half warp, as
//           in fp8_quantize.cu): the factor does not enter q, so the k rows of a token
//           share its codes and scale. Then for each j < k it computes the scaled row of
//           pair (t, j), rounds it to the dtype and stores it, the token's codes and scale
//           at dest. The next j's destinations and factors are loaded before this j's stores.
//           A null factor is every factor 1: the same products, so the same bits as factors
//           of 1.
// Every row has one writer whatever slots hold, so the result is deterministic, and no
// access leaves values, out, q or scales. The products, rounding and codes are those of
// the CPU kernel (fp8::scaled_element, row_tile_coder), so the results are bitwise equal.
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "common/fp8_blockwise.h"
#include "common/status.h"
#include "cuda/device.h"
#include "cuda/fp8_lanes.cuh"
#include "cuda/fp8_quantize.h"
#include "cuda/fp8_tile_codes.cuh"

namespace moe_xla {
namespace cuda {
namespace {

using detail::aligned;
using detail::Elem;
using detail::kLaneCols;
using detail::Lane;
using detail::round_lane;
using detail::scaled_element_ftz;
using detail::row_tile_coder;
using detail::store_lane;
using detail::TileCoder;

constexpr int kThreads = 256;
constexpr int kRowThreads = fp8::kTile / kLaneCols;        // 16 threads per 1 x 128 tile
constexpr int kPassTokens = kThreads / kRowThreads;        // token rows per pass of a CTA
constexpr int kTokens = 2;                                 // token rows per thread
constexpr int kRegionTokens = kPassTokens * kTokens;
constexpr int kMinCtas = 4;                                // 64 registers
constexpr int kStepThreads = 256;                          // claim and settle

constexpr size_t kAlign = 256;
constexpr size_t round_up(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

__global__ void claim_rows(const int32_t* __restrict__ slots, int64_t pairs, int64_t rows, int32_t* __restrict__ owner) {
  for (int64_t p = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; p < pairs; p += int64_t{gridDim.x} * blockDim.x) {
    const int32_t r = slots[p];
    if (r >= 0 && r < rows) atomicMax(owner + r, static_cast<int32_t>(p));
  }
}

// Index i < pairs: dest of pair i. Index i < rows: row i made a zero row (q 0, the scale of
// a zero tile) if no pair names it, lane by lane (lanes of 8 columns): in moe() every row
// is named, so the check is all the common case pays.
template <DType D, bool kVector>
__global__ void settle_rows(const int32_t* __restrict__ slots, const int32_t* __restrict__ owner,
                            int32_t* __restrict__ dest, typename Elem<D>::Bits* __restrict__ out,
                            uint8_t* __restrict__ q, float* __restrict__ scales, int64_t pairs, int64_t rows,
                            int64_t cols, float zero_scale) {
  const int64_t n = pairs > rows ? pairs : rows;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    if (i < pairs) {
      const int32_t r = slots[i];
      dest[i] = r >= 0 && r < rows && owner[r] == i ? r : -1;
    }
    if (i >= rows || owner[i] >= 0) continue;
    for (int64_t c = 0; c < cols; c += kLaneCols) {
      const int valid = static_cast<int>(cols - c < kLaneCols ? cols - c : kLaneCols);
      store_lane<kVector>(out + i * cols + c, Lane<typename Elem<D>::Bits>{}, valid);
      store_lane<kVector>(q + i * cols + c, Lane<uint8_t>{}, valid);
    }
    for (int64_t tile = 0; tile < fp8::tiles(cols); ++tile) scales[i * fp8::tiles(cols) + tile] = zero_scale;
  }
}

template <DType D, bool kVector>
__global__ void __launch_bounds__(kThreads, kMinCtas)
    expand_rows(const typename Elem<D>::Bits* __restrict__ values, const int32_t* __restrict__ dest,
                const float* __restrict__ factor, typename Elem<D>::Bits* __restrict__ out, uint8_t* __restrict__ q,
                float* __restrict__ scales, int64_t tokens, int64_t top_k, int64_t cols, int64_t col_tiles,
                bool pow2) {
  using Bits = typename Elem<D>::Bits;
  const int t = threadIdx.x;
  const int64_t tile = blockIdx.x % col_tiles, token0 = blockIdx.x / col_tiles * kRegionTokens + t / kRowThreads;
  const int64_t c = tile * fp8::kTile + (t % kRowThreads) * kLaneCols;
  const int valid = static_cast<int>(cols - c <= 0 ? 0 : (cols - c < kLaneCols ? cols - c : kLaneCols));

  Lane<Bits> x[kTokens]{};  // zeros past the last token and the row's end
#pragma unroll
  for (int i = 0; i < kTokens; ++i) {
    const int64_t token = token0 + i * kPassTokens;
    if (token >= tokens || valid == 0) continue;
    const Bits* src = values + token * cols + c;
    if constexpr (kVector) {
      x[i] = *reinterpret_cast<const Lane<Bits>*>(src);
    } else {
      for (int j = 0; j < valid; ++j) x[i].set(j, src[j]);
    }
  }

  // Each token row's 1 x 128 tile quantised once, unscaled: the row rnd(scaled_element(1, x))
  // (rounding back to the dtype is exact), whose codes and scale every row of the token takes.
  // Every thread of the warp takes part in row_tile_coder, whatever its token and columns.
  Lane<uint8_t> codes[kTokens];
  float scale[kTokens];
#pragma unroll
  for (int i = 0; i < kTokens; ++i) {
    float v[kLaneCols];
#pragma unroll
    for (int e = 0; e < kLaneCols; ++e) v[e] = scaled_element_ftz(1.0f, Elem<D>::to_float(x[i].get(e)));
    const Lane<Bits> row = round_lane<D>(v);
    const TileCoder coder = row_tile_coder<D>(row, pow2);
    codes[i] = coder.template codes<D>(row);
    scale[i] = coder.scale;
  }

  int32_t next_dest[kTokens];
  float next_factor[kTokens];
  auto load_pairs = [&](int64_t j) {
#pragma unroll
    for (int i = 0; i < kTokens; ++i) {
      const int64_t token = token0 + i * kPassTokens;
      next_dest[i] = token < tokens ? dest[token * top_k + j] : -1;
      next_factor[i] = token >= tokens ? 0.0f : factor == nullptr ? 1.0f : factor[token * top_k + j];
    }
  };
  load_pairs(0);
  for (int64_t j = 0; j < top_k; ++j) {
    int32_t r[kTokens];
    float k[kTokens];
#pragma unroll
    for (int i = 0; i < kTokens; ++i) r[i] = next_dest[i], k[i] = next_factor[i];
    if (j + 1 < top_k) load_pairs(j + 1);
#pragma unroll
    for (int i = 0; i < kTokens; ++i) {
      float v[kLaneCols];  // zeros past the row's end, whatever the factor
#pragma unroll
      for (int e = 0; e < kLaneCols; ++e) v[e] = e < valid ? scaled_element_ftz(k[i], Elem<D>::to_float(x[i].get(e))) : 0.0f;
      if (r[i] < 0 || valid == 0) continue;
      store_lane<kVector>(out + r[i] * cols + c, round_lane<D>(v), valid);
      store_lane<kVector>(q + r[i] * cols + c, codes[i], valid);
      if (t % kRowThreads == 0) scales[r[i] * col_tiles + tile] = scale[i];
    }
  }
}

unsigned step_blocks(int64_t n) {
  const int64_t blocks = (n + kStepThreads - 1) / kStepThreads;
  return static_cast<unsigned>(blocks < (1 << 20) ? blocks : (1 << 20));  // grid-stride past that
}

template <DType D, bool kVector>
cudaError_t expand(const Fp8ExpandQuantizeParams& p, int32_t* owner, int32_t* dest, cudaStream_t stream) {
  using Bits = typename Elem<D>::Bits;
  auto* out = static_cast<Bits*>(p.out);
  const int64_t pairs = p.num_values * p.top_k;
  const int64_t col_tiles = fp8::tiles(p.cols);
  cudaError_t err = cudaMemsetAsync(owner, 0xff, static_cast<size_t>(p.rows) * sizeof(int32_t), stream);
  if (err != cudaSuccess) return err;
  if (pairs > 0) {
    claim_rows<<<step_blocks(pairs), kStepThreads, 0, stream>>>(p.slots, pairs, p.rows, owner);
    if ((err = cudaGetLastError()) != cudaSuccess) return err;
  }
  settle_rows<D, kVector><<<step_blocks(pairs > p.rows ? pairs : p.rows), kStepThreads, 0, stream>>>(
      p.slots, owner, dest, out, p.q, p.scales, pairs, p.rows, p.cols, fp8::scale_from_amax(0.0f, p.pow2_scale));
  if ((err = cudaGetLastError()) != cudaSuccess) return err;
  if (pairs == 0 || p.num_values == 0) return cudaSuccess;
  const int64_t regions = (p.num_values + kRegionTokens - 1) / kRegionTokens * col_tiles;
  if (regions > 0x7fffffff) return cudaErrorInvalidConfiguration;
  expand_rows<D, kVector><<<static_cast<unsigned>(regions), kThreads, 0, stream>>>(
      static_cast<const Bits*>(p.values), dest, p.factor, out, p.q, p.scales, p.num_values, p.top_k, p.cols, col_tiles,
      p.pow2_scale);
  return cudaGetLastError();
}

template <DType D>
cudaError_t expand_for(const Fp8ExpandQuantizeParams& p, int32_t* owner, int32_t* dest, cudaStream_t stream) {
  using Bits = typename Elem<D>::Bits;
  const bool vector = p.cols % kLaneCols == 0 && aligned(p.values, sizeof(Lane<Bits>)) &&
                      aligned(p.out, sizeof(Lane<Bits>)) && aligned(p.q, kLaneCols);
  return vector ? expand<D, true>(p, owner, dest, stream) : expand<D, false>(p, owner, dest, stream);
}

}  // namespace

size_t fp8_expand_workspace_bytes(int64_t rows, int64_t pairs) {
  return round_up(static_cast<size_t>(rows > 0 ? rows : 0) * sizeof(int32_t)) +
         static_cast<size_t>(pairs > 0 ? pairs : 0) * sizeof(int32_t);
}

size_t fp8_expand_workspace_bytes(const Fp8ExpandQuantizeParams& p) {
  return fp8_expand_workspace_bytes(p.rows, p.num_values * p.top_k);
}

Status fp8_expand_quantize(const Fp8ExpandQuantizeParams& p, void* workspace, cudaStream_t stream) {
  MOE_XLA_RETURN_IF_ERROR(require_device(DeviceSupport::kSimt, "fp8 expand quantize"));
  if (p.num_values < 0 || p.top_k < 0 || p.rows < 0 || p.cols < 0) {
    return Status::InvalidArgument("fp8 expand quantize: negative dimension");
  }
  if (p.num_values * p.top_k > INT32_MAX || p.rows > INT32_MAX) {
    return Status::InvalidArgument("fp8 expand quantize: expected fewer than 2^31 pairs and rows, got " +
                                   std::to_string(p.num_values * p.top_k) + " pairs and " + std::to_string(p.rows) +
                                   " rows");
  }
  if (p.rows * p.cols == 0) return Status();
  auto* owner = static_cast<int32_t*>(workspace);
  auto* dest = reinterpret_cast<int32_t*>(static_cast<uint8_t*>(workspace) + round_up(p.rows * sizeof(int32_t)));
  cudaError_t err = cudaSuccess;
  switch (p.dtype) {
    case DType::kF32: err = expand_for<DType::kF32>(p, owner, dest, stream); break;
    case DType::kBF16: err = expand_for<DType::kBF16>(p, owner, dest, stream); break;
    case DType::kF16: err = expand_for<DType::kF16>(p, owner, dest, stream); break;
    default: return Status::InvalidArgument("fp8 expand quantize: unsupported dtype");
  }
  MOE_XLA_RETURN_IF_CUDA_ERROR(err);
  return Status();
}

}  // namespace cuda
}  // namespace moe_xla
