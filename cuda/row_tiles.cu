// The row-tile table of cuda/row_tiles.h: a group scan, then the table and the zeroing of
// the rows past the groups.
#include "cuda/row_tiles.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "common/status.h"
#include "cuda/group_offsets.cuh"
#include "cuda/grouped_gemm_internal.h"  // align_up, kWorkspaceAlign

namespace moe_xla {
namespace cuda {
namespace detail {
namespace {

constexpr int kFillThreads = 256;

size_t align_table(size_t bytes) { return align_up(bytes, kWorkspaceAlign); }

// Where group g's row tiles start in the table, and its rows [start, end).
struct alignas(16) GroupTiles {
  int32_t first_tile;
  int32_t start;
  int32_t end;
  int32_t unused;
};

// Offsets from the aligned base: group tiles | tile count | row-tile table.
struct TableLayout {
  size_t groups, count, row_tiles, total;
  TableLayout(int64_t m, int64_t num_groups, int tile_rows) {
    groups = 0;
    count = align_table(static_cast<size_t>(num_groups) * sizeof(GroupTiles));
    row_tiles = count + align_table(sizeof(RowTileCount));
    total = row_tiles + align_table(static_cast<size_t>(max_row_tiles(m, num_groups, tile_rows)) * sizeof(RowTile));
  }
};

// One block of kScanThreads: every group's first row tile and rows (scan_group_tiles of
// group_offsets.cuh), the number of row tiles and the covered rows.
__global__ void __launch_bounds__(kScanThreads)
    group_tiles_kernel(const int32_t* __restrict__ group_sizes, int64_t num_groups, int64_t m, int tile_rows,
                       GroupTiles* __restrict__ groups, RowTileCount* __restrict__ count) {
  int64_t tiles = 0;
  const int64_t covered = scan_group_tiles<kScanThreads>(
      group_sizes, num_groups, m, tile_rows, &tiles, [&](int64_t g, int64_t start, int64_t end, int64_t first) {
        groups[g] = GroupTiles{static_cast<int32_t>(first), static_cast<int32_t>(start), static_cast<int32_t>(end), 0};
      });
  if (threadIdx.x == 0) *count = RowTileCount{tiles, covered};
}

// The grid writes row tile i of the table for every i < count->row_tiles (its group: the
// last one whose first tile is <= i; empty groups share their first tile with the next
// group, so that one is never empty) and zeroes the output rows past the groups.
__global__ void __launch_bounds__(kFillThreads)
    row_tiles_kernel(const GroupTiles* __restrict__ groups, int64_t num_groups, int tile_rows,
                     const RowTileCount* __restrict__ count, RowTile* __restrict__ row_tiles,
                     uint4* __restrict__ out, int64_t m, int64_t row_vecs) {
  const RowTileCount c = *count;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < c.row_tiles; i += stride) {
    int64_t lo = 0, hi = num_groups - 1;  // groups[0].first_tile = 0 <= i
    while (lo < hi) {
      const int64_t mid = (lo + hi + 1) / 2;
      if (groups[mid].first_tile <= i) {
        lo = mid;
      } else {
        hi = mid - 1;
      }
    }
    const GroupTiles g = groups[lo];
    const int32_t begin = g.start + static_cast<int32_t>(i - g.first_tile) * tile_rows;
    const int32_t tiles = (g.end - g.start + tile_rows - 1) / tile_rows;
    row_tiles[i] = RowTile{static_cast<int32_t>(lo), begin, std::min(begin + tile_rows, g.end), g.first_tile, tiles, {}};
  }
  if (out != nullptr) zero_rows_from(out, c.covered, m, row_vecs);
}

}  // namespace

int64_t max_row_tiles(int64_t m, int64_t num_groups, int tile_rows) {
  return (m + tile_rows - 1) / tile_rows + num_groups;
}

size_t row_tile_table_bytes(int64_t m, int64_t num_groups, int tile_rows) {
  return TableLayout(m, num_groups, tile_rows).total;
}

Status enqueue_row_tile_table(const int32_t* group_sizes, int64_t num_groups, int64_t m, int tile_rows,
                              char* base, void* zero_out, int64_t row_vecs, int sm_count, cudaStream_t stream,
                              RowTileTable* table) {
  const TableLayout layout(m, num_groups, tile_rows);
  auto* groups = reinterpret_cast<GroupTiles*>(base + layout.groups);
  auto* count = reinterpret_cast<RowTileCount*>(base + layout.count);
  auto* row_tiles = reinterpret_cast<RowTile*>(base + layout.row_tiles);
  group_tiles_kernel<<<1, kScanThreads, 0, stream>>>(group_sizes, num_groups, m, tile_rows, groups, count);
  MOE_XLA_RETURN_IF_CUDA_ERROR(cudaGetLastError());  // launch of the group scan
  const int64_t max_tiles = max_row_tiles(m, num_groups, tile_rows);
  const int64_t work = std::max(max_tiles, zero_out != nullptr ? m * row_vecs : 0);
  const int64_t blocks = std::clamp<int64_t>((work + kFillThreads - 1) / kFillThreads, 1, 2 * int64_t{sm_count});
  row_tiles_kernel<<<static_cast<unsigned>(blocks), kFillThreads, 0, stream>>>(
      groups, num_groups, tile_rows, count, row_tiles, static_cast<uint4*>(zero_out), m, row_vecs);
  MOE_XLA_RETURN_IF_CUDA_ERROR(cudaGetLastError());  // launch of the row-tile table
  *table = RowTileTable{row_tiles, count, max_tiles};
  return Status();
}

}  // namespace detail
}  // namespace cuda
}  // namespace moe_xla
