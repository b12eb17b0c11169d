// CUDA FP8 blockwise quantisation (common/fp8_blockwise.h), one pass over x.
//
// A CTA covers a region of 128 columns of one batch entry; a thread owns 8 consecutive
// columns (16 threads per row) of several rows, loaded with one access each (16 bytes for
// bf16 / f16, kept packed in 32-bit words), all issued before any is used (RowsCta,
// BlocksCta and ActivatedCta below say how many):
//   row tiles: a 1 x 128 tile is the 16 threads of one row (a half warp): amax by
//              shuffles within it, one scale per row;
//   blocks:    regions of 128 rows (one 128 x 128 block): amax by warp shuffles, then
//              across the CTA's warps in shared memory, one scale.
// The loads in flight per SM set the bandwidth, hence several rows per thread, all loaded
// first; held as floats instead of packed words they spilled (the measurements of each
// shape are in benchmarks/results/LOG.md).
// Elements stay in registers as loaded from the amax to the quantisation (x is read
// once). The same kernel quantises the expert activation of h on the fly (Activated: the
// fused activate_quantize_fp8) and its backward (ActivationGrad:
// activate_grad_quantize_fp8), the row sources of cuda/fp8_row_sources.cuh. A fused
// source's keep() stores its rounded row once all the thread's rows are loaded: a store
// between two loads keeps the compiler from issuing the later load first (it cannot prove
// they do not alias). A gated backward with
// F % 128 == 0 has a kernel of its own (activate_grad_pairs) that computes both halves of
// d h and its d omega tile from one read of gate, up and g.
// Scale and elements go through common/fp8_blockwise.h like the CPU kernel, the elements
// by its division-free quotient where it gives the same codes (cuda/fp8_tile_codes.cuh);
// max is exact in any order, so the results are bitwise those of the CPU.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "common/expert_activation.h"
#include "common/fp8_blockwise.h"
#include "common/status.h"
#include "cuda/device.h"
#include "cuda/fp8_lanes.cuh"
#include "cuda/fp8_quantize.h"
#include "cuda/fp8_row_sources.cuh"
#include "cuda/fp8_tile_codes.cuh"

namespace moe_xla {
namespace cuda {
namespace {

using detail::Activated;
using detail::ActivationGrad;
using detail::aligned;
using detail::Elem;
using detail::finite_amax;
using detail::kFullWarp;
using detail::kLaneCols;
using detail::Lane;
using detail::lane_amax_exact;
using detail::lane_amax_nan;
using detail::max_nan;
using detail::round_lane;
using detail::row_tile_coder;
using detail::store_lane;
using detail::Stored;
using detail::TileCoder;

constexpr int kRowThreads = fp8::kTile / kLaneCols;  // 16 threads per row of a region

// A kernel's CTA: threads, rows per thread (passes, all loaded before any is used) and the
// CTAs per SM its register cap keeps resident.
template <int kThreadsV, int kPassesV, int kMinCtasV>
struct Cta {
  static constexpr int kThreads = kThreadsV, kPasses = kPassesV, kMinCtas = kMinCtasV;
  static constexpr int kPassRows = kThreads / kRowThreads;  // rows per pass of the CTA
  static constexpr int kRegionRows = kPassRows * kPasses;
};
// Row tiles: 4 rows per thread in CTAs of 256 with at most 64 registers (4 CTAs per SM;
// f32 needs 80: 3 CTAs). Blocks: 128 bytes of x in flight per thread, 8 rows of bf16 / f16
// in CTAs of 256 (64 registers, 4 CTAs per SM), 4 rows of f32 in CTAs of 512. The fused
// activation reads two inputs per element: 2 rows at 48 registers (5 CTAs per SM; f32 64,
// 4 CTAs). ptxas reports no spills for any of them; the row tiles ran no faster with 8
// rows per thread.
template <DType D>
using RowsCta = std::conditional_t<D == DType::kF32, Cta<256, 4, 3>, Cta<256, 4, 4>>;
template <DType D>
using BlocksCta = std::conditional_t<D == DType::kF32, Cta<512, 4, 2>, Cta<256, 8, 4>>;
template <DType D>
using ActivatedCta = std::conditional_t<D == DType::kF32, Cta<256, 2, 4>, Cta<256, 2, 5>>;
// The backward reads up to three inputs per element: 2 rows at 64 registers (f32 80: 3
// CTAs per SM; at 64 its three lanes of two rows spilled; its element-wise form, F % 8 != 0,
// spills 16 bytes).
template <DType D>
using ActivationGradCta = std::conditional_t<D == DType::kF32, Cta<256, 2, 3>, Cta<256, 2, 4>>;
static_assert(BlocksCta<DType::kF32>::kRegionRows == fp8::kTile && BlocksCta<DType::kBF16>::kRegionRows == fp8::kTile,
              "a blocks region is one 128 x 128 block");

struct Region {
  int64_t b, row0, col0;  // batch entry, first row, first column
};

__device__ __forceinline__ Region region_of(int64_t index, int64_t row_regions, int64_t col_tiles, int region_rows) {
  const int64_t ct = index % col_tiles, rest = index / col_tiles;
  return {rest / row_regions, (rest % row_regions) * region_rows, ct * fp8::kTile};
}

// One 128 x 128 block of q in shared memory, to be written transposed: put() takes a
// thread's 8 bytes of a row, store() writes q_t rows (the block's columns) 16 bytes at a
// time, each gathered down a column. The odd row pitch puts a warp's byte stores and its
// column gathers in different banks.
struct TransposedBlock {
  static constexpr int kPitch = fp8::kTile + 1;
  static constexpr int kChunk = 16;  // bytes of a q_t row per store
  uint8_t bytes[fp8::kTile * kPitch];

  __device__ __forceinline__ void put(int row, int col, const Lane<uint8_t>& v) {
#pragma unroll
    for (int j = 0; j < kLaneCols; ++j) bytes[row * kPitch + col + j] = v.get(j);
  }

  // q_t rows reg.col0 .. reg.col0 + 127 (within cols), columns reg.row0 .. + 127 (within rows).
  __device__ __forceinline__ void store(uint8_t* __restrict__ q_t, const Region& reg, int64_t rows, int64_t cols,
                                        int threads) {
    constexpr int kChunksPerRow = fp8::kTile / kChunk;
    const bool vector = rows % kChunk == 0;  // 16-byte aligned q_t rows (q_t itself is)
    for (int i = threadIdx.x; i < fp8::kTile * kChunksPerRow; i += threads) {
      const int n = i / kChunksPerRow, part = i % kChunksPerRow;
      const int64_t qn = reg.col0 + n, k0 = reg.row0 + part * kChunk;
      if (qn >= cols || k0 >= rows) continue;
      uint8_t* dst = q_t + (reg.b * cols + qn) * rows + k0;
      if (vector) {
        uint32_t w[kChunk / 4];
#pragma unroll
        for (int v = 0; v < kChunk / 4; ++v) {
          const uint8_t* src = bytes + (part * kChunk + 4 * v) * kPitch + n;
          w[v] = uint32_t{src[0]} | uint32_t{src[kPitch]} << 8 | uint32_t{src[2 * kPitch]} << 16 |
                 uint32_t{src[3 * kPitch]} << 24;
        }
        *reinterpret_cast<uint4*>(dst) = uint4{w[0], w[1], w[2], w[3]};
      } else {
        const int64_t len = rows - k0 < kChunk ? rows - k0 : kChunk;
        for (int r = 0; r < len; ++r) dst[r] = bytes[(part * kChunk + r) * kPitch + n];
      }
    }
  }
};

// The max of v over a CTA of kWarps warps (NaN-propagating where kNan), through slots.
template <int kWarps, bool kNan>
__device__ __forceinline__ float cta_max(float v, float* slots) {
  auto op = [](float a, float b) { return kNan ? max_nan(a, b) : fmaxf(a, b); };
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) v = op(v, __shfl_xor_sync(kFullWarp, v, offset));
  if (threadIdx.x % 32 == 0) slots[threadIdx.x / 32] = v;
  __syncthreads();
#pragma unroll
  for (int w = 0; w < kWarps; ++w) v = op(v, slots[w]);
  return v;
}

// kBlocks: one 128 x 128 block per region, else C::kRegionRows rows of 1 x 128 tiles. Source: Stored,
// Activated or ActivationGrad; kVector: cols % 8 == 0 and every pointer aligned for Lane accesses.
// kTransposed (blocks): q_t [batch, cols, rows] gets the block transposed too, through
// shared memory (TransposedBlock).
template <DType D, bool kBlocks, bool kVector, class Source, class C, bool kTransposed = false>
__global__ void __launch_bounds__(C::kThreads, C::kMinCtas)
    quantize_regions(Source src, uint8_t* __restrict__ q, uint8_t* __restrict__ q_t, float* __restrict__ scales,
                     int64_t rows, int64_t cols, int64_t row_regions, int64_t col_tiles, bool pow2) {
  static_assert(kBlocks || !kTransposed, "only blocks are written transposed");
  using Bits = typename Elem<D>::Bits;
  const int t = threadIdx.x;
  constexpr int kRows = C::kPassRows, kPasses = C::kPasses;
  const Region reg = region_of(blockIdx.x, row_regions, col_tiles, C::kRegionRows);
  const int col = (t % kRowThreads) * kLaneCols;  // within the region
  const int64_t c = reg.col0 + col;
  const int valid = static_cast<int>(cols - c <= 0 ? 0 : (cols - c < kLaneCols ? cols - c : kLaneCols));
  const int first = t / kRowThreads;               // row within the region of pass 0

  Lane<Bits> raw[kPasses];  // the elements to quantise; zero bits outside the matrix
  [[maybe_unused]] float dots[kPasses];
  if constexpr (Source::kWordsAreElements) {
    // x itself: its words are the elements, loaded straight into raw (a second array of
    // them made the bf16 blocks kernels spill 72-80 bytes at their 64 registers).
#pragma unroll
    for (int i = 0; i < kPasses; ++i) {
      const int64_t r = reg.row0 + first + i * kRows;
      raw[i] = r < rows && valid > 0 ? src.load(reg.b, r, c, valid) : Lane<Bits>{};
    }
  } else {
    // Every row's words, then the elements: all of a thread's loads are issued before any
    // is used (cuda/fp8_row_sources.cuh).
    typename Source::Words words[kPasses]{};
#pragma unroll
    for (int i = 0; i < kPasses; ++i) {
      const int64_t r = reg.row0 + first + i * kRows;
      if (r < rows && valid > 0) words[i] = src.fetch(reg.b, r, c, valid);
    }
#pragma unroll
    for (int i = 0; i < kPasses; ++i) {
      const int64_t r = reg.row0 + first + i * kRows;
      const bool inside = r < rows && valid > 0;
      raw[i] = inside ? src.value(words[i], c, valid) : Lane<Bits>{};
      if constexpr (Source::kRowDots) dots[i] = inside ? src.dot(words[i], c, valid) : 0.0f;
    }
  }
  if constexpr (Source::kRowDots) {
#pragma unroll
    for (int i = 0; i < kPasses; ++i) {
      // The 16 threads of a row are a half warp.
#pragma unroll
      for (int offset = kRowThreads / 2; offset > 0; offset /= 2) dots[i] += __shfl_xor_sync(kFullWarp, dots[i], offset);
      const int64_t r = reg.row0 + first + i * kRows;
      if (t % kRowThreads == 0 && r < rows) src.keep_dot(r, reg.col0 / fp8::kTile, dots[i]);
    }
  }

  TileCoder coder[kBlocks ? 1 : kPasses];
  if constexpr (kBlocks) {
    // The block's amax: each thread's, then the warp's, then the CTA's through shared memory.
    constexpr int kWarps = C::kThreads / 32;
    __shared__ float warp_amax[2][kWarps];
    float amax = 0.0f;
#pragma unroll
    for (int i = 0; i < kPasses; ++i) amax = lane_amax_nan<D>(amax, raw[i]);
    amax = cta_max<kWarps, true>(amax, warp_amax[0]);
    if (finite_amax(amax)) {
      coder[0] = TileCoder::of(amax, pow2, true);
    } else {  // the same for the whole CTA
      float m = 0.0f;
#pragma unroll
      for (int i = 0; i < kPasses; ++i) m = lane_amax_exact<D>(m, raw[i]);
      coder[0] = TileCoder::of(cta_max<kWarps, false>(m, warp_amax[1]), pow2, false);
    }
    if (t == 0) scales[blockIdx.x] = coder[0].scale;  // regions are numbered as the scales
  } else {
#pragma unroll
    for (int i = 0; i < kPasses; ++i) {
      // The 16 threads of a row are a half warp.
      coder[i] = row_tile_coder<D>(raw[i], pow2);
      const int64_t r = reg.row0 + first + i * kRows;
      if (t % kRowThreads == 0 && r < rows) {
        scales[(reg.b * rows + r) * col_tiles + reg.col0 / fp8::kTile] = coder[i].scale;
      }
    }
  }

  [[maybe_unused]] TransposedBlock* block = nullptr;
  if constexpr (kTransposed) {
    __shared__ TransposedBlock shared_block;
    block = &shared_block;
  }
#pragma unroll
  for (int i = 0; i < kPasses; ++i) {
    const int64_t r = reg.row0 + first + i * kRows;
    const Lane<uint8_t> out = coder[kBlocks ? 0 : i].template codes<D>(raw[i]);
    if constexpr (kTransposed) block->put(first + i * kRows, col, out);
    if (r >= rows || valid == 0) continue;
    src.keep(r, c, raw[i], valid);
    store_lane<kVector>(q + (reg.b * rows + r) * cols + c, out, valid);
  }
  if constexpr (kTransposed) {
    __syncthreads();
    block->store(q_t, reg, rows, cols, C::kThreads);
  }
}

template <DType D, bool kBlocks, class C, class Source>
cudaError_t launch(const Source& src, uint8_t* q, uint8_t* q_t, float* scales, int64_t batch, int64_t rows,
                   int64_t cols, bool pow2, cudaStream_t stream) {
  const int64_t row_regions = (rows + C::kRegionRows - 1) / C::kRegionRows;
  const int64_t col_tiles = fp8::tiles(cols);
  const int64_t regions = batch * row_regions * col_tiles;
  if (regions > 0x7fffffff) return cudaErrorInvalidConfiguration;
  const unsigned grid = static_cast<unsigned>(regions);
  if constexpr (kBlocks) {
    if (q_t != nullptr) {
      quantize_regions<D, true, Source::kVector, Source, C, true><<<grid, C::kThreads, 0, stream>>>(
          src, q, q_t, scales, rows, cols, row_regions, col_tiles, pow2);
      return cudaGetLastError();
    }
  }
  quantize_regions<D, kBlocks, Source::kVector, Source, C><<<grid, C::kThreads, 0, stream>>>(
      src, q, nullptr, scales, rows, cols, row_regions, col_tiles, pow2);
  return cudaGetLastError();
}

template <DType D>
cudaError_t quantize(const Fp8QuantizeParams& p, cudaStream_t stream) {
  using Bits = typename Elem<D>::Bits;
  const bool vector = p.cols % kLaneCols == 0 && aligned(p.x, sizeof(Lane<Bits>)) && aligned(p.q, kLaneCols);
  const auto* x = static_cast<const Bits*>(p.x);
  auto run = [&](auto src, auto blocks) {
    constexpr bool kBlocks = decltype(blocks)::value;
    using C = std::conditional_t<kBlocks, BlocksCta<D>, RowsCta<D>>;
    return launch<D, kBlocks, C>(src, p.q, p.q_t, p.scales, p.batch, p.rows, p.cols, p.pow2_scale, stream);
  };
  auto with_tiles = [&](auto src) {
    return p.tile_rows == 1 ? run(src, std::false_type{}) : run(src, std::true_type{});
  };
  return vector ? with_tiles(Stored<D, true>{x, p.rows, p.cols}) : with_tiles(Stored<D, false>{x, p.rows, p.cols});
}

// The 1 x 128 row tiles of a source that reads `in` and stores its rounded rows to `out`
// (Activated) for params p of rows x cols: make(std::bool_constant<kVector>)
// builds it, with vector accesses where the columns and every pointer allow them.
template <DType D, class C, class Params, class Make>
cudaError_t fused_rows(const Params& p, const void* in, const void* out, cudaStream_t stream, Make make) {
  using Bits = typename Elem<D>::Bits;
  const bool vector = p.cols % kLaneCols == 0 && aligned(in, sizeof(Lane<Bits>)) && aligned(out, sizeof(Lane<Bits>)) &&
                      aligned(p.q, kLaneCols);
  auto run = [&](auto src) {
    return launch<D, false, C>(src, p.q, nullptr, p.scales, 1, p.rows, p.cols, p.pow2_scale, stream);
  };
  return vector ? run(make(std::true_type{})) : run(make(std::false_type{}));
}

template <DType D>
cudaError_t activate_quantize(const Fp8ActivateQuantizeParams& p, cudaStream_t stream) {
  using Bits = typename Elem<D>::Bits;
  return fused_rows<D, ActivatedCta<D>>(p, p.h, p.a, stream, [&](auto vector) {
    return Activated<D, decltype(vector)::value>{static_cast<const Bits*>(p.h), static_cast<Bits*>(p.a), p.cols,
                                                 p.activation};
  });
}

// The gated backward when F % 128 == 0 (every tile inside one half): a thread owns 8 gate
// columns of kPairRows rows and the same 8 up columns; it reads gate, up and g once,
// computes g and g' of the gate once (gated_grad) and writes both halves of d h,
// whose two 1 x 128 tiles per row are each the 16 threads of a half warp. Regions of
// 16 * kPairRows rows x 128 gate columns.
constexpr int kPairRows = 2;
constexpr int kPairThreads = 256;
constexpr int kPairRegionRows = kPairThreads / kRowThreads * kPairRows;

template <DType D>
__global__ void __launch_bounds__(kPairThreads, 3)
    activate_grad_pairs(const typename Elem<D>::Bits* __restrict__ h, const typename Elem<D>::Bits* __restrict__ g_in,
                        const float* __restrict__ omega, typename Elem<D>::Bits* __restrict__ dh,
                        uint8_t* __restrict__ q, float* __restrict__ scales, float* __restrict__ d_omega_tiles,
                        int64_t rows, int64_t f, int64_t row_regions, Activation act, bool pow2) {
  using Bits = typename Elem<D>::Bits;
  const int t = threadIdx.x;
  const int64_t col_tiles = f / fp8::kTile;
  const Region reg = region_of(blockIdx.x, row_regions, col_tiles, kPairRegionRows);
  const int64_t c = reg.col0 + (t % kRowThreads) * kLaneCols;
  const int first = t / kRowThreads;
  Lane<Bits> g[kPairRows]{}, u[kPairRows]{}, d[kPairRows]{};  // zeros past the last row
  float w[kPairRows]{};
#pragma unroll
  for (int i = 0; i < kPairRows; ++i) {
    const int64_t r = reg.row0 + first + i * (kPairThreads / kRowThreads);
    if (r >= rows) continue;
    g[i] = *reinterpret_cast<const Lane<Bits>*>(h + r * 2 * f + c);
    u[i] = *reinterpret_cast<const Lane<Bits>*>(h + r * 2 * f + f + c);
    d[i] = *reinterpret_cast<const Lane<Bits>*>(g_in + r * f + c);
    w[i] = __ldg(omega + r);
  }
#pragma unroll
  for (int i = 0; i < kPairRows; ++i) {
    const int64_t r = reg.row0 + first + i * (kPairThreads / kRowThreads);
    float d_gate[kLaneCols], d_up[kLaneCols], dot = 0.0f;
#pragma unroll
    for (int j = 0; j < kLaneCols; ++j) {
      const float gc = Elem<D>::to_float(d[i].get(j));
      const GatedGrad e = gated_grad(act, Elem<D>::to_float(g[i].get(j)), Elem<D>::to_float(u[i].get(j)), w[i] * gc);
      d_gate[j] = e.d_gate;
      d_up[j] = e.d_up;
      dot += gc * Elem<D>::to_float(Elem<D>::from_float(e.a));
    }
#pragma unroll
    for (int offset = kRowThreads / 2; offset > 0; offset /= 2) dot += __shfl_xor_sync(kFullWarp, dot, offset);
    if (t % kRowThreads == 0 && r < rows) d_omega_tiles[r * col_tiles + reg.col0 / fp8::kTile] = dot;
    const Lane<Bits> halves[2] = {round_lane<D>(d_gate), round_lane<D>(d_up)};  // rounded to D
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const TileCoder coder = row_tile_coder<D>(halves[half], pow2);
      const Lane<uint8_t> out = coder.codes<D>(halves[half]);
      if (r >= rows) continue;
      const int64_t col = half * f + c;
      store_lane<true>(dh + r * 2 * f + col, halves[half], kLaneCols);
      store_lane<true>(q + r * 2 * f + col, out, kLaneCols);
      if (t % kRowThreads == 0) scales[r * 2 * col_tiles + half * col_tiles + reg.col0 / fp8::kTile] = coder.scale;
    }
  }
}

template <DType D>
cudaError_t activate_grad_quantize(const Fp8ActivateGradQuantizeParams& p, cudaStream_t stream) {
  using Bits = typename Elem<D>::Bits;
  const int64_t f = is_gated(p.activation) ? p.cols / 2 : p.cols;
  const bool vector = f % kLaneCols == 0 && aligned(p.h, sizeof(Lane<Bits>)) && aligned(p.g, sizeof(Lane<Bits>)) &&
                      aligned(p.dh, sizeof(Lane<Bits>)) && aligned(p.q, kLaneCols);
  const auto* h = static_cast<const Bits*>(p.h);
  const auto* g = static_cast<const Bits*>(p.g);
  auto* dh = static_cast<Bits*>(p.dh);
  if (vector && is_gated(p.activation) && f % fp8::kTile == 0) {
    const int64_t row_regions = (p.rows + kPairRegionRows - 1) / kPairRegionRows;
    const int64_t regions = row_regions * (f / fp8::kTile);
    if (regions > 0x7fffffff) return cudaErrorInvalidConfiguration;
    activate_grad_pairs<D><<<static_cast<unsigned>(regions), kPairThreads, 0, stream>>>(
        h, g, p.omega, dh, p.q, p.scales, p.d_omega_tiles, p.rows, f, row_regions, p.activation, p.pow2_scale);
    return cudaGetLastError();
  }
  auto run = [&](auto src) {
    return launch<D, false, ActivationGradCta<D>>(src, p.q, nullptr, p.scales, 1, p.rows, p.cols, p.pow2_scale, stream);
  };
  return vector ? run(ActivationGrad<D, true>{h, g, p.omega, dh, p.d_omega_tiles, p.cols, p.activation})
                : run(ActivationGrad<D, false>{h, g, p.omega, dh, p.d_omega_tiles, p.cols, p.activation});
}

template <template <DType> class Body, class Params>
Status by_dtype(const Params& p, cudaStream_t stream, const char* op) {
  switch (p.dtype) {
    case DType::kF32: MOE_XLA_RETURN_IF_CUDA_ERROR(Body<DType::kF32>::run(p, stream)); break;
    case DType::kBF16: MOE_XLA_RETURN_IF_CUDA_ERROR(Body<DType::kBF16>::run(p, stream)); break;
    case DType::kF16: MOE_XLA_RETURN_IF_CUDA_ERROR(Body<DType::kF16>::run(p, stream)); break;
    default: return Status::InvalidArgument(std::string(op) + ": unsupported dtype");
  }
  return Status();
}

template <DType D>
struct Quantize {
  static cudaError_t run(const Fp8QuantizeParams& p, cudaStream_t stream) { return quantize<D>(p, stream); }
};
template <DType D>
struct ActivateQuantize {
  static cudaError_t run(const Fp8ActivateQuantizeParams& p, cudaStream_t stream) {
    return activate_quantize<D>(p, stream);
  }
};

template <DType D>
struct ActivateGradQuantize {
  static cudaError_t run(const Fp8ActivateGradQuantizeParams& p, cudaStream_t stream) {
    return activate_grad_quantize<D>(p, stream);
  }
};

}  // namespace

Status fp8_quantize(const Fp8QuantizeParams& p, cudaStream_t stream) {
  MOE_XLA_RETURN_IF_ERROR(require_device(DeviceSupport::kSimt, "fp8 quantize"));
  if (p.batch < 0 || p.rows < 0 || p.cols < 0) return Status::InvalidArgument("fp8 quantize: negative dimension");
  if (p.tile_rows != 1 && p.tile_rows != fp8::kTile) {
    return Status::InvalidArgument("fp8 quantize: tile_rows must be 1 or 128, got " + std::to_string(p.tile_rows));
  }
  if (p.q_t != nullptr && p.tile_rows != fp8::kTile) {
    return Status::InvalidArgument("fp8 quantize: q_t is written for 128 x 128 blocks only");
  }
  if (p.q_t != nullptr && !aligned(p.q_t, 16)) return Status::InvalidArgument("fp8 quantize: q_t is not 16-byte aligned");
  if (p.batch * p.rows * p.cols == 0) return Status();
  return by_dtype<Quantize>(p, stream, "fp8 quantize");
}

Status fp8_activate_quantize(const Fp8ActivateQuantizeParams& p, cudaStream_t stream) {
  MOE_XLA_RETURN_IF_ERROR(require_device(DeviceSupport::kSimt, "fp8 activate quantize"));
  if (p.rows < 0 || p.cols < 0) return Status::InvalidArgument("fp8 activate quantize: negative dimension");
  if (static_cast<int32_t>(p.activation) < 0 || static_cast<int32_t>(p.activation) >= kNumActivations) {
    return Status::InvalidArgument("fp8 activate quantize: unknown activation " +
                                   std::to_string(static_cast<int32_t>(p.activation)));
  }
  if (p.rows * p.cols == 0) return Status();
  return by_dtype<ActivateQuantize>(p, stream, "fp8 activate quantize");
}

Status fp8_activate_grad_quantize(const Fp8ActivateGradQuantizeParams& p, cudaStream_t stream) {
  MOE_XLA_RETURN_IF_ERROR(require_device(DeviceSupport::kSimt, "fp8 activate grad quantize"));
  if (p.rows < 0 || p.cols < 0) return Status::InvalidArgument("fp8 activate grad quantize: negative dimension");
  if (static_cast<int32_t>(p.activation) < 0 || static_cast<int32_t>(p.activation) >= kNumActivations) {
    return Status::InvalidArgument("fp8 activate grad quantize: unknown activation " +
                                   std::to_string(static_cast<int32_t>(p.activation)));
  }
  if (is_gated(p.activation) && p.cols % 2 != 0) {
    return Status::InvalidArgument("fp8 activate grad quantize: a gated activation needs an even width, got " +
                                   std::to_string(p.cols));
  }
  if (p.rows * p.cols == 0) return Status();
  return by_dtype<ActivateGradQuantize>(p, stream, "fp8 activate grad quantize");
}

}  // namespace cuda
}  // namespace moe_xla
