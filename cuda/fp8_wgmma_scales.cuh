// The scales of our Hopper FP8 kernel's consumers (fp8_wgmma_kernel.cuh): per K step j the
// combined scales fl(lhs_scales[r, j] * rhs_scales[g, j, b]) of a thread's two tile rows r
// and the tile's one or two 128-column rhs blocks b, and the promotion of a step's block
// sum P into the tile's total, total = fma(scale, P, total) per accumulator.
#ifndef MOE_XLA_CUDA_FP8_WGMMA_SCALES_CUH_
#define MOE_XLA_CUDA_FP8_WGMMA_SCALES_CUH_

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "cute/tensor.hpp"  // first: the atoms below rely on its declarations
#include "cute/arch/mma_sm90_gmma.hpp"
#include "cutlass/cutlass.h"

#include "common/fp8_blockwise.h"
#include "cuda/row_tiles.h"

namespace moe_xla {
namespace cuda {
namespace detail {

// The combined scales fl(s_lhs * s_rhs) of one K step for a thread's two rows (lo: r,
// hi: r + 8) and the tile's two rhs scale blocks (0: the columns before the tile's split,
// 1: those after; a 128-column tile has block 0 only).
struct Fp8StepScales {
  float lo0, hi0, lo1, hi1;
};

// total = fma(s, P, total) per accumulator, s the combined scale of the value's row and
// column block. In the m64nN wgmma fragment value i lies in row (i >> 1) & 1 of the
// thread's two rows and in the i / 4-th group of 8 columns, so block 0 holds the values with
// i / 4 < kSplitGroups.
template <int kSplitGroups, class Accum>
__device__ __forceinline__ void fp8_promote(Accum& total, Accum& acc, const Fp8StepScales& s) {
  using namespace cute;
  warpgroup_fence_operand(acc);
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < size(acc); ++i) {
    const float scale = i / 4 < kSplitGroups ? ((i & 2) ? s.hi0 : s.lo0) : ((i & 2) ? s.hi1 : s.lo1);
    total(i) = __fmaf_rn(scale, acc(i), total(i));
  }
}

// fp8_promote at a tile's split: column 128 (all of a 128-column tile, an even 192-column
// tile) or 64 (an odd 192-column tile, split_64), as a constant of the unrolled loop.
template <int kTileN, class Accum>
__device__ __forceinline__ void fp8_promote_tile(Accum& total, Accum& acc, const Fp8StepScales& s, bool split_64) {
  if constexpr (kTileN != fp8::kTile) {
    if (split_64) {
      fp8_promote<8>(total, acc, s);
      return;
    }
  }
  fp8_promote<fp8::kTile / 8>(total, acc, s);
}

// A consumer thread's scales for one unit: the scale rows of its two tile rows (clamped
// into lhs: rows past M are never stored) and the tile's rhs scale blocks (clamped: columns
// past N are zero-filled by TMA and never stored), each step's read one step ahead.
// kTwoBlocks: the tile spans two blocks (wider than 128 columns).
template <bool kTwoBlocks>
struct Fp8UnitScales {
  const float* sa_lo;
  const float* sa_hi;
  const float* sb0;       // block 0 of step 0; step j's at + j * n_blocks
  int32_t block1_offset;  // block 1 - block 0 (0 where block 0 is rhs's last)
  int32_t n_blocks, k_tiles;
  float next_lo, next_hi, next_b0, next_b1;  // the next step's scales

  __device__ __forceinline__ Fp8UnitScales(const float* lhs_scales, const float* rhs_scales, int32_t m,
                                           int32_t n_blocks_, int32_t k_tiles_, const RowTile& tile, int32_t col0,
                                           int32_t row_lo, int32_t row_hi)
      : n_blocks(n_blocks_), k_tiles(k_tiles_) {
    constexpr int32_t kBlock = fp8::kTile;
    sa_lo = lhs_scales + static_cast<int64_t>(std::min(tile.row_begin + row_lo, m - 1)) * k_tiles;
    sa_hi = lhs_scales + static_cast<int64_t>(std::min(tile.row_begin + row_hi, m - 1)) * k_tiles;
    const int32_t block0 = std::min(col0 / kBlock, n_blocks - 1);
    sb0 = rhs_scales + static_cast<int64_t>(tile.group) * k_tiles * n_blocks + block0;
    block1_offset = std::min(block0 + 1, n_blocks - 1) - block0;
    next_lo = __ldg(sa_lo);
    next_hi = __ldg(sa_hi);
    next_b0 = __ldg(sb0);
    next_b1 = 0.0f;
    if constexpr (kTwoBlocks) next_b1 = __ldg(sb0 + block1_offset);
  }

  // Step j's combined scales; loads step j + 1's.
  __device__ __forceinline__ Fp8StepScales take(int j) {
    const Fp8StepScales s{__fmul_rn(next_lo, next_b0), __fmul_rn(next_hi, next_b0), __fmul_rn(next_lo, next_b1),
                          __fmul_rn(next_hi, next_b1)};
    if (j + 1 < k_tiles) {
      const int64_t b = static_cast<int64_t>(j + 1) * n_blocks;
      next_lo = __ldg(sa_lo + j + 1);
      next_hi = __ldg(sa_hi + j + 1);
      next_b0 = __ldg(sb0 + b);
      if constexpr (kTwoBlocks) next_b1 = __ldg(sb0 + b + block1_offset);
    }
    return s;
  }
};

}  // namespace detail
}  // namespace cuda
}  // namespace moe_xla

#endif  // MOE_XLA_CUDA_FP8_WGMMA_SCALES_CUH_
