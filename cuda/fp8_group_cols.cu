// CUDA FP8 quantisation in 128 x 1 column tiles that restart at every group boundary,
// written transposed (common/fp8_blockwise.h, Fp8GroupColsParams): the operands of the
// FP8 wgrad; with q given, the 1 x 128 row tiles of the same x too, from the same read;
// with sources given, of rows gathered from token rows (and scaled by factor for the
// column tiles) as they are read.
//
// One CTA per (tile, run of kBlocksPerCta column blocks of 128). The CTA first finds its
// tile's rows from the group sizes (a block scan, amortised over the run), then per
// 128 x 128 block every thread loads 8 consecutive columns of 8 consecutive rows (all
// loads issued before any is used, as the row-tile kernels do); the column amax goes
// through warp shuffles and shared memory. A thread's 8 rows of one column are 8
// consecutive bytes of a q_t row, so it stores them directly: the 4 threads of a warp
// that share a column write 32 consecutive bytes (whole sectors). A row tile is the 8
// columns of 16 threads: the 8 lanes of a row group in each of two warps (shuffles, then
// shared memory). The segments cover every row, so every row tile is written once.
// Gathered rows: the CTA reads its tile's sources (and factors) into shared memory once;
// a thread loads its 8 rows from their tokens (zeros for a source outside the tokens) and
// flushes them in place, rnd(scaled_element(1, x)), the row tiles' rows u; with factors it
// codes the row tiles first, then scales its rows in place into the column tiles' rows
// rnd(scaled_element(factor, x)), one copy of the rows in registers (x is u except where
// the flush zeroed it: below 2^-126 a zero gives the same product; a thread with an
// element equal to +-2^-126, which a factor above 1 keeps, loads its rows again). These are the products of the expansion kernel (fp8_expand_rows.cu), so the
// codes are bitwise those of its output quantised by this kernel. Activated rows:
// a thread fetches the gate and up words of its 8 rows of h, then computes their
// activation (fp8_row_sources.cuh's Activated, the row kernel's own), so the codes are
// bitwise those of that kernel's a quantised by this one, and a is never written. Scale
// and elements go through common/fp8_blockwise.h like the CPU kernel, the elements by its
// division-free quotient where it gives the same codes (cuda/fp8_tile_codes.cuh); max is
// exact in any order, so the results are bitwise those of the CPU.
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "common/fp8_blockwise.h"
#include "common/status.h"
#include "cuda/device.h"
#include "cuda/fp8_lanes.cuh"
#include "cuda/fp8_quantize.h"
#include "cuda/fp8_row_sources.cuh"
#include "cuda/fp8_tile_codes.cuh"
#include "cuda/group_offsets.cuh"

namespace moe_xla {
namespace cuda {
namespace {

using detail::aligned;
using detail::Elem;
using detail::kLaneCols;
using detail::Lane;
using detail::store_lane;
using detail::TileCoder;

constexpr int kThreads = 256;
constexpr int kRowRuns = 8;                          // consecutive rows per thread
constexpr int kColLanes = fp8::kTile / kLaneCols;    // 16 column lanes of 8 columns
constexpr int kRowGroups = fp8::kTile / kRowRuns;    // 16 row groups of 8 rows
static_assert(kColLanes * kRowGroups == kThreads, "a CTA covers one 128 x 128 block");
static_assert(kRowRuns == kLaneCols, "a thread codes its 8 rows of a column as one lane");
// A warp: 8 column lanes x 4 row groups (32 consecutive bytes per q_t row it writes);
// warps 2w and 2w + 1 take the two halves of the columns.
constexpr int kWarpColLanes = 8, kWarpRowGroups = 4;
constexpr int kWarps = kThreads / 32;
constexpr int kBlocksPerCta = 4;  // column blocks per CTA (one scan each)

// CTAs per SM: the register cap of 2 (128 registers) holds a thread's 8 x 8 elements and
// the column amax's second, exact pass without spilling (at 3 CTAs, 80 registers, the
// 16-bit kernels spilled and took 3% longer over the benchmark cases; LOG.md, session 24).
constexpr int kMinCtas = 2;

// Where a CTA's rows come from (Fp8GroupColsParams): x's rows in place, or gathered through
// sources with every factor 1, or gathered and scaled by factor in the column tiles, or
// the expert activation of x = h.
enum class Source { kStored, kGathered, kScaled, kActivated };

// The row tiles of a thread's 8 rows (rows `row` .. `row` + 7 of the tile, columns `col` ..
// `col` + 7 of the block): each row's 128 columns are the 8 lanes of its row group (lanes
// differing in their low 3 bits) in warps 2w and 2w + 1. The amax as the row-tile kernels
// take it (max.NaN of |x|, then max m(x) for a tile with an inf or NaN: row_tile_coder),
// then the codes and the scales of the rows inside the tile. Every thread calls it.
template <DType D, bool kVec>
__device__ __forceinline__ void store_row_tiles(const Lane<typename Elem<D>::Bits> (&raw)[kRowRuns], int64_t first_row,
                                                int nrows, int64_t c, int valid, int64_t block, int64_t col_blocks,
                                                int64_t cols, bool pow2, uint8_t* __restrict__ q,
                                                float* __restrict__ row_scales) {
  __shared__ float partner[kWarps][kWarpRowGroups * kRowRuns];  // each warp's half-row amaxes
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int slot = lane / kWarpColLanes * kRowRuns;
  // Per row, the amax of the thread's half row, then of the whole row.
  auto row_amax = [&](auto magnitude, auto max2, float (&amax)[kRowRuns]) {
#pragma unroll
    for (int i = 0; i < kRowRuns; ++i) {
      float a = 0.0f;
#pragma unroll
      for (int j = 0; j < kLaneCols; ++j) a = max2(a, magnitude(Elem<D>::to_float(raw[i].get(j))));
#pragma unroll
      for (int offset = kWarpColLanes / 2; offset > 0; offset /= 2) {
        a = max2(a, __shfl_xor_sync(detail::kFullWarp, a, offset));
      }
      amax[i] = a;
      if (lane % kWarpColLanes == 0) partner[warp][slot + i] = a;
    }
    __syncthreads();
#pragma unroll
    for (int i = 0; i < kRowRuns; ++i) amax[i] = max2(amax[i], partner[warp ^ 1][slot + i]);
    __syncthreads();  // partner is rewritten by the exact pass
  };
  float amax[kRowRuns], exact[kRowRuns] = {};
  row_amax([](float v) { return fabsf(v); }, detail::max_nan, amax);
  bool nonfinite = false;
#pragma unroll
  for (int i = 0; i < kRowRuns; ++i) nonfinite |= !detail::finite_amax(amax[i]);
  if (__syncthreads_or(nonfinite)) row_amax(fp8::tile_magnitude, fmaxf, exact);  // the same for the whole CTA
#pragma unroll
  for (int i = 0; i < kRowRuns; ++i) {
    const bool finite = detail::finite_amax(amax[i]);
    const TileCoder coder = TileCoder::of(finite ? amax[i] : exact[i], pow2, finite);
    if (i >= nrows || valid == 0) continue;
    const int64_t r = first_row + i;
    store_lane<kVec>(q + r * cols + c, coder.template codes<D>(raw[i]), valid);
    if (warp % 2 == 0 && lane % kWarpColLanes == 0) row_scales[r * col_blocks + block] = coder.scale;
  }
}

// The lane's elements as scaled_value(1, x): the flush of magnitudes at most 2^-126.
template <DType D>
__device__ __forceinline__ Lane<typename Elem<D>::Bits> flushed(const Lane<typename Elem<D>::Bits>& raw) {
  float v[kLaneCols];
#pragma unroll
  for (int j = 0; j < kLaneCols; ++j) v[j] = detail::scaled_element_ftz(1.0f, Elem<D>::to_float(raw.get(j)));
  return detail::round_lane<D>(v);
}

// kRows: q and row_scales get the row tiles too (store_row_tiles); always with a gathered
// or activated source. sources, factor and values_rows are read for gathered sources only.
// kAct: the activation of the activated source, a constant so that each element's
// activation is straight-line code (a switch per element kept the 64 elements of a thread
// from overlapping: 3-6x the unfused kernels' time, LOG.md session 48).
template <DType D, bool kVec, bool kRows, Source kSource, Activation kAct>
__global__ void __launch_bounds__(kThreads, kMinCtas)
    quantize_group_cols_kernel(const typename Elem<D>::Bits* __restrict__ x, const int32_t* __restrict__ group_sizes,
                               int64_t num_groups, uint8_t* __restrict__ q_t, float* __restrict__ scales,
                               uint8_t* __restrict__ q, float* __restrict__ row_scales, int64_t rows, int64_t cols,
                               bool pow2, const int32_t* __restrict__ sources, const float* __restrict__ factor,
                               int64_t values_rows) {
  using Bits = typename Elem<D>::Bits;
  constexpr bool kGather = kSource == Source::kGathered || kSource == Source::kScaled;
  static_assert(kRows || kSource == Source::kStored, "gathered and activated rows come with their row tiles");
  __shared__ int64_t tile_rows[2];  // first row, rows of this CTA's tile
  __shared__ int32_t row_source[kGather ? fp8::kTile : 1];  // the tile's token rows (-1: none)
  __shared__ float row_factor[kSource == Source::kScaled ? fp8::kTile : 1];
  __shared__ float warp_amax[kWarps / 2][fp8::kTile];
  __shared__ TileCoder col_coder[fp8::kTile];

  const int64_t tile = blockIdx.x;
  const int64_t width = fp8::kTile * static_cast<int64_t>(gridDim.x);  // 128 T
  const int t = threadIdx.x, lane = t % 32, warp = t / 32;
  if (t == 0) tile_rows[0] = tile_rows[1] = 0;
  __syncthreads();
  // The tile's segment: a group, or the rows past the groups (thread 0 after the scan).
  auto claim = [&](int64_t start, int64_t end, int64_t first) {
    const int64_t r0 = start + (tile - first) * fp8::kTile;
    if (tile >= first && r0 < end) {
      tile_rows[0] = r0;
      tile_rows[1] = end - r0 < fp8::kTile ? end - r0 : fp8::kTile;
    }
  };
  int64_t group_tiles = 0;
  const int64_t covered = detail::scan_group_tiles<kThreads>(
      group_sizes, num_groups, rows, fp8::kTile, &group_tiles,
      [&](int64_t, int64_t start, int64_t end, int64_t first) { claim(start, end, first); });
  if (t == 0) claim(covered, rows, group_tiles);
  __syncthreads();
  const int64_t r0 = tile_rows[0], nrows = tile_rows[1];
  if constexpr (kGather) {
    if (t < fp8::kTile) {
      int32_t src = -1;
      float k = 1.0f;  // a zero row stays +0 whatever its factor's sign
      if (t < nrows) {
        const int32_t s = sources[r0 + t];
        if (s >= 0 && s < values_rows) {
          src = s;
          if constexpr (kSource == Source::kScaled) k = factor[r0 + t];
        }
      }
      row_source[t] = src;
      if constexpr (kSource == Source::kScaled) row_factor[t] = k;
    }
    __syncthreads();
  }

  const int col = ((warp % 2) * kWarpColLanes + lane % kWarpColLanes) * kLaneCols;  // in the block
  const int row = ((warp / 2) * kWarpRowGroups + lane / kWarpColLanes) * kRowRuns;   // in the tile
  const int64_t col_blocks = fp8::tiles(cols);
  const int64_t cb_end = (blockIdx.y + 1) * int64_t{kBlocksPerCta};
  for (int64_t cb = blockIdx.y * int64_t{kBlocksPerCta}; cb < col_blocks && cb < cb_end; ++cb) {
    const int64_t c = cb * fp8::kTile + col;
    const int valid = static_cast<int>(cols - c <= 0 ? 0 : (cols - c < kLaneCols ? cols - c : kLaneCols));
    Lane<Bits> raw[kRowRuns];  // zero bits outside the tile's rows and the matrix
    if constexpr (kSource == Source::kActivated) {
      // Every row's words are fetched before any is used (one load in flight per row).
      const detail::Activated<D, kVec> act{x, nullptr, cols, kAct};
      typename detail::Activated<D, kVec>::Words words[kRowRuns];
#pragma unroll
      for (int i = 0; i < kRowRuns; ++i) {
        words[i] = {};
        if (row + i < nrows && valid > 0) words[i] = act.fetch(0, r0 + row + i, c, valid);
      }
#pragma unroll
      for (int i = 0; i < kRowRuns; ++i) {
        raw[i] = row + i < nrows && valid > 0 ? act.value(words[i], c, valid) : Lane<Bits>{};
      }
    }
    // The thread's 8 stored or gathered rows.
    auto load_rows = [&] {
#pragma unroll
      for (int i = 0; i < kRowRuns; ++i) {
        raw[i] = Lane<Bits>{};
        int64_t source = row + i < nrows ? r0 + row + i : -1;
        if constexpr (kGather) source = row_source[row + i];  // -1 past the tile's rows too
        if (source >= 0 && valid > 0) {
          const Bits* src = x + source * cols + c;
          if constexpr (kVec) {
            raw[i] = *reinterpret_cast<const Lane<Bits>*>(src);
          } else {
#pragma unroll
            for (int j = 0; j < kLaneCols; ++j) raw[i].set(j, j < valid ? src[j] : Bits{0});
          }
        }
      }
    };
    if constexpr (kSource != Source::kActivated) load_rows();
    bool smallest = false;  // kScaled: one of the thread's elements is +-2^-126
    if constexpr (kSource == Source::kScaled) {
#pragma unroll
      for (int i = 0; i < kRowRuns; ++i) {
#pragma unroll
        for (int j = 0; j < kLaneCols; ++j) smallest |= fabsf(Elem<D>::to_float(raw[i].get(j))) == 0x1p-126f;
      }
    }
    if constexpr (kGather) {
#pragma unroll
      for (int i = 0; i < kRowRuns; ++i) raw[i] = flushed<D>(raw[i]);
    }
    if constexpr (kSource == Source::kScaled) {
      store_row_tiles<D, kVec>(raw, r0 + row, static_cast<int>(nrows - row), c, valid, cb, col_blocks, cols, pow2, q,
                               row_scales);
      if (smallest) load_rows();  // rare: the flushed rows lost an element a factor may keep
#pragma unroll
      for (int i = 0; i < kRowRuns; ++i) {
        const float k = row_factor[row + i];
        float v[kLaneCols];
#pragma unroll
        for (int j = 0; j < kLaneCols; ++j) v[j] = detail::scaled_element_ftz(k, Elem<D>::to_float(raw[i].get(j)));
        raw[i] = detail::round_lane<D>(v);
      }
    }
    // Element j of the thread's row i as the column tiles take it.
    auto col_value = [&](int i, int j) { return Elem<D>::to_float(raw[i].get(j)); };
    // Column amax: over the thread's rows, the warp's row groups (lanes l, l + 8, l + 16,
    // l + 24 share columns), then the warps of the same column half. First as the row
    // tiles do it, max.NaN of |x| (one instruction per element): for finite elements it is
    // the amax of their tile magnitudes once TileCoder::of reads a subnormal amax as 0.
    // A block with an inf or NaN anywhere takes the amax of tile_magnitude instead, and
    // codes element by element (fp8_tile_codes.cuh).
    // Returns whether one of the thread's own partial maxima is not finite (with max.NaN:
    // whether one of its elements is an inf or NaN).
    auto column_amax = [&](auto magnitude, auto max2) {
      bool nonfinite = false;
#pragma unroll
      for (int j = 0; j < kLaneCols; ++j) {
        float amax = 0.0f;
#pragma unroll
        for (int i = 0; i < kRowRuns; ++i) amax = max2(amax, magnitude(col_value(i, j)));
        nonfinite |= !detail::finite_amax(amax);
        amax = max2(amax, __shfl_xor_sync(detail::kFullWarp, amax, kWarpColLanes));
        amax = max2(amax, __shfl_xor_sync(detail::kFullWarp, amax, 2 * kWarpColLanes));
        if (lane < kWarpColLanes) warp_amax[warp / 2][col + j] = amax;
      }
      return nonfinite;
    };
    const bool any_nonfinite = __syncthreads_or(column_amax([](float v) { return fabsf(v); }, detail::max_nan));
    if (any_nonfinite) {  // the same for the whole CTA
      column_amax(fp8::tile_magnitude, fmaxf);
      __syncthreads();
    }
    if (t < fp8::kTile) {
      float amax = 0.0f;
#pragma unroll
      for (int w = 0; w < kWarps / 2; ++w) amax = fmaxf(amax, warp_amax[w][t]);
      col_coder[t] = TileCoder::of(amax, pow2, !any_nonfinite);
      if (cb * fp8::kTile + t < cols) scales[tile * cols + cb * fp8::kTile + t] = col_coder[t].scale;
    }
    __syncthreads();
#pragma unroll
    for (int j = 0; j < kLaneCols; ++j) {
      if (j >= valid) break;
      float v[kRowRuns];  // rows row .. row + 7 of column c + j
#pragma unroll
      for (int i = 0; i < kRowRuns; ++i) v[i] = col_value(i, j);
      const Lane<uint8_t> out = col_coder[col + j].codes(v);
      store_lane<true>(q_t + (c + j) * width + tile * fp8::kTile + row, out, kLaneCols);
    }
    if constexpr (kRows && kSource != Source::kScaled) {
      store_row_tiles<D, kVec>(raw, r0 + row, static_cast<int>(nrows - row), c, valid, cb, col_blocks, cols, pow2, q,
                               row_scales);
    }
    __syncthreads();  // col_coder is rewritten by the next block
  }
}

template <DType D>
cudaError_t launch(const Fp8GroupColsParams& p, cudaStream_t stream) {
  using Bits = typename Elem<D>::Bits;
  const int64_t tiles = group_col_tiles(p.rows, p.num_groups);
  const int64_t runs = (fp8::tiles(p.cols) + kBlocksPerCta - 1) / kBlocksPerCta;
  if (tiles > 0x7fffffff || runs > 65535) return cudaErrorInvalidConfiguration;
  const dim3 grid(static_cast<unsigned>(tiles), static_cast<unsigned>(runs));
  const auto* x = static_cast<const Bits*>(p.x);
  const bool rows = p.q != nullptr;
  const bool vector = p.cols % kLaneCols == 0 && aligned(p.x, sizeof(Lane<Bits>)) && (!rows || aligned(p.q, kLaneCols));
  auto run = [&](auto vec, auto with_rows, auto source, auto act) {
    quantize_group_cols_kernel<D, decltype(vec)::value, decltype(with_rows)::value, decltype(source)::value,
                               decltype(act)::value>
        <<<grid, kThreads, 0, stream>>>(x, p.group_sizes, p.num_groups, p.q_t, p.scales, p.q, p.row_scales, p.rows,
                                        p.cols, p.pow2_scale, p.sources, p.factor, p.values_rows);
  };
  // The activated source with its activation as a constant (the others ignore it).
  auto activated = [&](auto vec) {
    using A = Activation;
    using Activated = std::integral_constant<Source, Source::kActivated>;
    switch (p.activation) {
      case A::kSwiglu: run(vec, std::true_type{}, Activated{}, std::integral_constant<A, A::kSwiglu>{}); break;
      case A::kGeglu: run(vec, std::true_type{}, Activated{}, std::integral_constant<A, A::kGeglu>{}); break;
      case A::kGelu: run(vec, std::true_type{}, Activated{}, std::integral_constant<A, A::kGelu>{}); break;
      case A::kSilu: run(vec, std::true_type{}, Activated{}, std::integral_constant<A, A::kSilu>{}); break;
      case A::kRelu: run(vec, std::true_type{}, Activated{}, std::integral_constant<A, A::kRelu>{}); break;
    }
  };
  auto with_source = [&](auto vec) {
    using Stored = std::integral_constant<Source, Source::kStored>;
    using Unused = std::integral_constant<Activation, Activation::kSwiglu>;
    switch (p.source) {
      case GroupColsRows::kStored:
        rows ? run(vec, std::true_type{}, Stored{}, Unused{}) : run(vec, std::false_type{}, Stored{}, Unused{});
        break;
      case GroupColsRows::kGathered:
        if (p.factor == nullptr) {
          run(vec, std::true_type{}, std::integral_constant<Source, Source::kGathered>{}, Unused{});
        } else {
          run(vec, std::true_type{}, std::integral_constant<Source, Source::kScaled>{}, Unused{});
        }
        break;
      case GroupColsRows::kActivated:
        activated(vec);
        break;
    }
  };
  vector ? with_source(std::true_type{}) : with_source(std::false_type{});
  return cudaGetLastError();
}

}  // namespace

Status fp8_quantize_group_cols(const Fp8GroupColsParams& p, cudaStream_t stream) {
  MOE_XLA_RETURN_IF_ERROR(require_device(DeviceSupport::kSimt, "fp8 quantize group cols"));
  if (p.rows < 0 || p.cols < 0 || p.num_groups < 0) {
    return Status::InvalidArgument("fp8 quantize group cols: negative dimension");
  }
  if (p.cols == 0 || group_col_tiles(p.rows, p.num_groups) == 0) return Status();
  if (!aligned(p.q_t, kRowRuns)) return Status::InvalidArgument("fp8 quantize group cols: q_t is not 8-byte aligned");
  // Empty buffers may come as null pointers: with no rows there is no row tile to write.
  if (p.rows > 0 && (p.q == nullptr) != (p.row_scales == nullptr)) {
    return Status::InvalidArgument("fp8 quantize group cols: q and row_scales must be given together");
  }
  if (p.num_groups > 0 && p.group_sizes == nullptr) {
    return Status::InvalidArgument("fp8 quantize group cols: null group_sizes");
  }
  const bool gathered = p.source == GroupColsRows::kGathered;
  const bool activation = p.source == GroupColsRows::kActivated;
  if (!gathered && !activation && p.source != GroupColsRows::kStored) {
    return Status::InvalidArgument("fp8 quantize group cols: unknown row source");
  }
  if (!gathered && (p.sources != nullptr || p.factor != nullptr)) {
    return Status::InvalidArgument("fp8 quantize group cols: sources and factor belong to gathered rows");
  }
  if (p.source != GroupColsRows::kStored && p.rows > 0 && p.q == nullptr) {
    return Status::InvalidArgument("fp8 quantize group cols: gathered and activation rows need q and row_scales");
  }
  if (gathered && p.rows > 0 && p.sources == nullptr) {
    return Status::InvalidArgument("fp8 quantize group cols: gathered rows need sources");
  }
  if (gathered && p.values_rows < 0) {
    return Status::InvalidArgument("fp8 quantize group cols: negative values_rows");
  }
  if (activation && static_cast<uint32_t>(p.activation) >= static_cast<uint32_t>(kNumActivations)) {
    return Status::InvalidArgument("fp8 quantize group cols: unknown activation");
  }
  switch (p.dtype) {
    case DType::kF32: MOE_XLA_RETURN_IF_CUDA_ERROR(launch<DType::kF32>(p, stream)); break;
    case DType::kBF16: MOE_XLA_RETURN_IF_CUDA_ERROR(launch<DType::kBF16>(p, stream)); break;
    case DType::kF16: MOE_XLA_RETURN_IF_CUDA_ERROR(launch<DType::kF16>(p, stream)); break;
    default: return Status::InvalidArgument("fp8 quantize group cols: unsupported dtype");
  }
  return Status();
}

}  // namespace cuda
}  // namespace moe_xla
