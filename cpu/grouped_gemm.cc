// CPU grouped products (contract in common/grouped_gemm.h), as output tiles spread over
// threads.
//
// Every output element is one float sum in a fixed order, whatever the tiling, the thread
// count or the SIMD width:
//   gmm   out[r, n]    = sum over k = 0 .. K-1 of a[r, k] * b_g[k, n]
//   tgmm  out[g, k, n] = sum over the group's rows r, in order, of a[r, k] * b[r, n]
// each term a product then an add in float (no fused multiply-add: the file is compiled
// with -ffp-contract=off), starting from 0. So a row's result does not depend on M, on
// the other rows, or on the machine's vector unit: the layer's results are bitwise equal
// run to run and between the single-device and the expert-parallel layer.
//
// Work items: gmm tiles of kTileRows rows of one group x kTileCols columns; tgmm tiles of
// kTileRows of K x kTileCols of N of one group. A thread converts the operands of its
// tile to float once, then a register-blocked kernel (kBlockRows x kBlockCols
// accumulators) runs the inner loop; the hot functions are compiled for AVX2 and a
// baseline, picked at load time (target_clones).
#include "cpu/grouped_gemm.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu/dtype.h"
#include "cpu/parallel.h"

namespace moe_xla::cpu {
namespace {

constexpr int64_t kTileRows = 128;
constexpr int64_t kTileCols = 256;
constexpr int64_t kChunkRows = 256;  // tgmm: rows of the contraction converted at a time
constexpr int kBlockRows = 4;
constexpr int kBlockCols = 16;
constexpr int64_t kDepthSlice = 256;

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define MOE_XLA_CPU_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define MOE_XLA_CPU_CLONES
#endif

int64_t round_up(int64_t x, int64_t a) { return (x + a - 1) / a * a; }

// Eight floats as one GCC/Clang vector: AVX2 registers in the avx2 clone, pairs of SSE
// registers in the baseline one; element-wise IEEE products and sums either way.
typedef float Vec8 __attribute__((vector_size(32)));
constexpr int kVecs = kBlockCols / 8;

__attribute__((always_inline)) inline Vec8 load8(const float* p) {
  Vec8 v;
  __builtin_memcpy(&v, p, sizeof v);
  return v;
}

__attribute__((always_inline)) inline void store8(float* p, Vec8 v) { __builtin_memcpy(p, &v, sizeof v); }

// c[i, j] (+)= sum_{s < depth} a[i * a_row + s * a_step] * b[s * ldb + j], for i < rows
// (a multiple of kBlockRows) and j < cols (a multiple of kBlockCols), s in order. With
// accumulate, the sums continue from c; else they start at 0. The depth is walked in
// slices of kDepthSlice so that the kBlockCols-wide strip of b a slice reads stays in L1
// while every row block of the tile passes over it; a sum crosses slices through c
// unchanged (float stored and reloaded), so the order of its terms is still s = 0, 1, ...
MOE_XLA_CPU_CLONES
void tile_kernel(const float* a, int64_t a_row, int64_t a_step, const float* b, int64_t ldb, int64_t depth,
                 float* c, int64_t ldc, int64_t rows, int64_t cols, bool accumulate) {
  if (depth == 0 && !accumulate) {
    for (int64_t i = 0; i < rows; ++i) std::fill(c + i * ldc, c + i * ldc + cols, 0.0f);
  }
  for (int64_t s0 = 0; s0 < depth; s0 += kDepthSlice) {
    const int64_t s1 = std::min(depth, s0 + kDepthSlice);
    const bool from_c = accumulate || s0 > 0;
    for (int64_t j0 = 0; j0 < cols; j0 += kBlockCols) {
      for (int64_t i0 = 0; i0 < rows; i0 += kBlockRows) {
        Vec8 acc[kBlockRows][kVecs];
        for (int i = 0; i < kBlockRows; ++i) {
          for (int v = 0; v < kVecs; ++v) acc[i][v] = from_c ? load8(c + (i0 + i) * ldc + j0 + 8 * v) : Vec8{};
        }
        const float* a_block = a + i0 * a_row;
        for (int64_t s = s0; s < s1; ++s) {
          const float* b_row = b + s * ldb + j0;
          Vec8 b_vec[kVecs];
          for (int v = 0; v < kVecs; ++v) b_vec[v] = load8(b_row + 8 * v);
          for (int i = 0; i < kBlockRows; ++i) {
            const float a_is = a_block[i * a_row + s * a_step];
            for (int v = 0; v < kVecs; ++v) acc[i][v] += a_is * b_vec[v];
          }
        }
        for (int i = 0; i < kBlockRows; ++i) {
          for (int v = 0; v < kVecs; ++v) store8(c + (i0 + i) * ldc + j0 + 8 * v, acc[i][v]);
        }
      }
    }
  }
}

// Calls fn(load) with load(base, i) -> float for dtype t, so that loops over elements
// convert without a switch per element.
template <class Fn>
void with_loader(DType t, Fn fn) {
  switch (t) {
    case DType::kF32: return fn([](const void* base, int64_t i) { return static_cast<const float*>(base)[i]; });
    case DType::kBF16: return fn([](const void* base, int64_t i) { return bf16_to_float(static_cast<const uint16_t*>(base)[i]); });
    case DType::kF16: return fn([](const void* base, int64_t i) { return f16_to_float(static_cast<const uint16_t*>(base)[i]); });
  }
}

// dst[r * ld_dst + c] = src[(row0 + r) * ld_src + col0 + c] as float for r < rows, c < cols;
// the rest of the [rows_padded, ld_dst] block is 0.
void load_tile(const void* src, DType t, int64_t ld_src, int64_t row0, int64_t rows, int64_t col0, int64_t cols,
               float* dst, int64_t rows_padded, int64_t ld_dst) {
  with_loader(t, [&](auto load) {
    for (int64_t r = 0; r < rows_padded; ++r) {
      float* d = dst + r * ld_dst;
      const int64_t n = r < rows ? cols : 0;
      const int64_t from = (row0 + r) * ld_src + col0;
      for (int64_t c = 0; c < n; ++c) d[c] = load(src, from + c);
      std::fill(d + n, d + ld_dst, 0.0f);
    }
  });
}

// dst[i * ld_dst + j] = src[(col0 + j) * ld_src + i] as float for i < rows, j < cols (a
// transposed tile), the rest of each of the `rows` rows of width ld_dst 0. In passes over
// kTransposeSpan rows of dst, so the dst lines being filled stay in L1 while j advances
// (a new dst line per element otherwise: gmm with transpose_rhs was 2.5x slower where
// this load dominates, groups of ~10 rows).
constexpr int64_t kTransposeSpan = 8;
void load_tile_transposed(const void* src, DType t, int64_t ld_src, int64_t col0, int64_t cols, int64_t rows,
                          float* dst, int64_t ld_dst) {
  with_loader(t, [&](auto load) {
    for (int64_t i0 = 0; i0 < rows; i0 += kTransposeSpan) {
      const int64_t i1 = std::min(rows, i0 + kTransposeSpan);
      for (int64_t j = 0; j < cols; ++j) {
        const int64_t from = (col0 + j) * ld_src;
        for (int64_t i = i0; i < i1; ++i) dst[i * ld_dst + j] = load(src, from + i);
      }
    }
  });
  for (int64_t i = 0; i < rows; ++i) std::fill(dst + i * ld_dst + cols, dst + (i + 1) * ld_dst, 0.0f);
}

// dst[(row0 + r) * ld_dst + col0 + c] = src[r * ld_src + c] in dtype t, for r < rows, c < cols.
void store_tile(void* dst, DType t, int64_t ld_dst, int64_t row0, int64_t rows, int64_t col0, int64_t cols,
                const float* src, int64_t ld_src) {
  auto rows_as = [&](auto* out, auto convert) {
    for (int64_t r = 0; r < rows; ++r) {
      auto* o = out + (row0 + r) * ld_dst + col0;
      for (int64_t c = 0; c < cols; ++c) o[c] = convert(src[r * ld_src + c]);
    }
  };
  switch (t) {
    case DType::kF32: return rows_as(static_cast<float*>(dst), [](float v) { return v; });
    case DType::kBF16: return rows_as(static_cast<uint16_t*>(dst), float_to_bf16);
    case DType::kF16: return rows_as(static_cast<uint16_t*>(dst), float_to_f16);
  }
}

struct Scratch {
  std::vector<float> a, b, c;
  float* sized(std::vector<float>& v, int64_t n) {
    if (static_cast<int64_t>(v.size()) < n) v.resize(n);
    return v.data();
  }
};

// One output tile: rows [row0, row0 + rows) of group g (gmm) or of K (tgmm), columns
// [col0, col0 + cols).
struct Tile {
  int64_t group, start, size;  // the group and its rows [start, start + size) of M
  int64_t row0, rows, col0, cols;
};

// The clamped row range [starts[g], starts[g] + sizes[g]) of every group (common/grouped_gemm.h).
struct Groups {
  std::vector<int64_t> starts, sizes;
  int64_t covered = 0;  // rows in some group

  explicit Groups(const GroupedGemmParams& p) : starts(p.num_groups), sizes(p.num_groups) {
    for (int64_t g = 0; g < p.num_groups; ++g) {
      starts[g] = covered;
      sizes[g] = clamp_group_size(p.group_sizes[g], covered, p.m);
      covered += sizes[g];
    }
  }
};

void gmm_tile(const GroupedGemmParams& p, const Tile& t, Scratch& s) {
  const int64_t k = p.k, n = p.n;
  const bool transposed = p.layout == GroupedLayout::kGmmTransposed;
  const int64_t rows_padded = round_up(t.rows, kBlockRows), cols_padded = round_up(t.cols, kBlockCols);
  float* a = s.sized(s.a, rows_padded * k);
  float* b = s.sized(s.b, k * cols_padded);
  float* c = s.sized(s.c, rows_padded * cols_padded);
  // a[s, i] = lhs[row0 + i, s]: the tile's rows side by side, so that the kernel reads
  // the kBlockRows values of one step s from one cache line.
  load_tile_transposed(p.lhs, p.in_dtype, k, t.row0, t.rows, k, a, rows_padded);
  // b[kk, j] = B_g[kk, col0 + j]: rows of rhs[g] [K, N], or columns of rhs[g] [N, K].
  const void* rhs_g = static_cast<const char*>(p.rhs) + t.group * k * n * dtype_bytes(p.in_dtype);
  if (transposed) {
    load_tile_transposed(rhs_g, p.in_dtype, k, t.col0, t.cols, k, b, cols_padded);
  } else {
    load_tile(rhs_g, p.in_dtype, n, 0, k, t.col0, t.cols, b, k, cols_padded);
  }
  tile_kernel(a, 1, rows_padded, b, cols_padded, k, c, cols_padded, rows_padded, cols_padded, false);
  store_tile(p.out, p.out_dtype, n, t.row0, t.rows, t.col0, t.cols, c, cols_padded);
}

// out[g, row0 + i, col0 + j] over the group's rows in kChunkRows chunks: a^T (K rows of
// the tile x chunk) and b (chunk x the tile's columns) converted per chunk, sums carried
// in c from chunk to chunk.
void tgmm_tile(const GroupedGemmParams& p, const Tile& t, Scratch& s) {
  const int64_t k = p.k, n = p.n;
  const int64_t rows_padded = round_up(t.rows, kBlockRows), cols_padded = round_up(t.cols, kBlockCols);
  float* c = s.sized(s.c, rows_padded * cols_padded);
  std::fill(c, c + rows_padded * cols_padded, 0.0f);
  float* a = s.sized(s.a, kChunkRows * rows_padded);
  float* b = s.sized(s.b, kChunkRows * cols_padded);
  for (int64_t r0 = t.start; r0 < t.start + t.size; r0 += kChunkRows) {
    const int64_t chunk = std::min(kChunkRows, t.start + t.size - r0);
    load_tile(p.lhs, p.in_dtype, k, r0, chunk, t.row0, t.rows, a, chunk, rows_padded);  // a[s, i]
    load_tile(p.rhs, p.in_dtype, n, r0, chunk, t.col0, t.cols, b, chunk, cols_padded);  // b[s, j]
    // c[i, j] += sum_s a[s, i] b[s, j]: row i of "A" steps by 1 across i and rows_padded across s.
    tile_kernel(a, 1, rows_padded, b, cols_padded, chunk, c, cols_padded, rows_padded, cols_padded, true);
  }
  store_tile(p.out, p.out_dtype, n, t.group * k + t.row0, t.rows, t.col0, t.cols, c, cols_padded);
}

std::vector<Tile> tiles(const GroupedGemmParams& p, const Groups& groups) {
  const bool tgmm = p.layout == GroupedLayout::kTgmm;
  std::vector<Tile> out;
  for (int64_t g = 0; g < p.num_groups; ++g) {
    const int64_t start = groups.starts[g], size = groups.sizes[g];
    if (!tgmm && size == 0) continue;
    const int64_t row_begin = tgmm ? 0 : start, row_end = tgmm ? p.k : start + size;
    for (int64_t row0 = row_begin; row0 < row_end; row0 += kTileRows) {
      for (int64_t col0 = 0; col0 < p.n; col0 += kTileCols) {
        out.push_back({g, start, size, row0, std::min(kTileRows, row_end - row0), col0, std::min(kTileCols, p.n - col0)});
      }
    }
  }
  return out;
}

}  // namespace

void grouped_gemm(const GroupedGemmParams& p, int64_t threads, const Schedule& schedule) {
  const bool tgmm = p.layout == GroupedLayout::kTgmm;
  const Groups groups(p);
  const std::vector<Tile> work = tiles(p, groups);
  parallel_for<Scratch>(static_cast<int64_t>(work.size()), std::max<int64_t>(threads, 1), schedule,
                        [&](Scratch& s, int64_t i) {
                          if (tgmm) {
                            tgmm_tile(p, work[i], s);
                          } else {
                            gmm_tile(p, work[i], s);
                          }
                        });
  if (!tgmm && groups.covered < p.m) {  // rows past the last group: +0.0 is all zero bits in each dtype
    const size_t elem = dtype_bytes(p.out_dtype);
    std::memset(static_cast<char*>(p.out) + groups.covered * p.n * elem, 0, (p.m - groups.covered) * p.n * elem);
  }
}

}  // namespace moe_xla::cpu
