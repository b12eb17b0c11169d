// The tiling of the FP8 wgrad operands (common/fp8_blockwise.h, Fp8GroupColsParams) from
// host group sizes: the segments of rows and the 128-row tiles each one starts at. Shared
// by the CPU quantisation in group column tiles and the CPU wgrad, which must agree on it.
#ifndef MOE_XLA_CPU_FP8_GROUP_TILES_H_
#define MOE_XLA_CPU_FP8_GROUP_TILES_H_

#include <cstdint>
#include <vector>

#include "common/fp8_blockwise.h"
#include "common/grouped_gemm.h"

namespace moe_xla::cpu {

struct GroupColSegment {
  int64_t start;       // first row
  int64_t rows;        // number of rows (clamped as common/grouped_gemm.h says)
  int64_t first_tile;  // its tiles are first_tile .. first_tile + fp8::tiles(rows) - 1
};

// The G + 1 segments in row order: the groups of `group_sizes` (host memory), then the
// rows past the last group. Tile numbers run on from segment to segment, so the last
// segment ends at or below group_col_tiles(rows, num_groups).
inline std::vector<GroupColSegment> group_col_segments(const int32_t* group_sizes, int64_t num_groups,
                                                       int64_t rows) {
  std::vector<GroupColSegment> segments;
  segments.reserve(static_cast<size_t>(num_groups + 1));
  int64_t start = 0, tile = 0;
  for (int64_t g = 0; g <= num_groups; ++g) {
    const int64_t len = g < num_groups ? clamp_group_size(group_sizes[g], start, rows) : rows - start;
    segments.push_back({start, len, tile});
    start += len;
    tile += fp8::tiles(len);
  }
  return segments;
}

}  // namespace moe_xla::cpu

#endif  // MOE_XLA_CPU_FP8_GROUP_TILES_H_
