// The table of row tiles that the persistent Hopper GEMM kernels walk (the gather GEMM,
// the FP8 wgmma GEMM): group sizes on the device become, on the device, one entry per
// tile of at most `tile_rows` rows of one group, group by group. Built by two small
// kernels enqueued on the caller's stream (no host copy, CUDA-graph safe).
#ifndef MOE_XLA_CUDA_ROW_TILES_H_
#define MOE_XLA_CUDA_ROW_TILES_H_

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "common/status.h"

namespace moe_xla {
namespace cuda {
namespace detail {

// One row tile: rows [row_begin, row_end) of group `group`, at most tile_rows of them; the
// group's tiles are entries [group_first, group_first + group_tiles) of the table.
struct alignas(16) RowTile {
  int32_t group;
  int32_t row_begin;
  int32_t row_end;
  int32_t group_first;
  int32_t group_tiles;
  int32_t unused[3];
};

// Written next to the table: how many row tiles it holds, and the rows the groups cover
// (rows [covered, M) belong to no group).
struct alignas(16) RowTileCount {
  int64_t row_tiles;
  int64_t covered;
};

// The table as the kernels read it (device pointers) and an upper bound of its length.
struct RowTileTable {
  const RowTile* tiles;
  const RowTileCount* count;
  int64_t max_tiles;
};

// Row tiles of all groups of M rows: sum_g ceil(rows_g / tile_rows) <= ceil(M / tile_rows) + G.
int64_t max_row_tiles(int64_t m, int64_t num_groups, int tile_rows);

// Bytes of device scratch the table needs (from a 256-byte aligned base).
size_t row_tile_table_bytes(int64_t m, int64_t num_groups, int tile_rows);

// Enqueues the table's two kernels on `stream`: group sizes (clamped as
// common/grouped_gemm.h says) -> the table at `base` (256-byte aligned, at least
// row_tile_table_bytes). When `zero_out` is not null, the second kernel also zeroes the
// output rows [covered, M) of zero_out, rows of `row_vecs` 16-byte vectors. `sm_count`
// bounds its grid. 0 < num_groups, 0 < tile_rows, M and the tiles within int32.
Status enqueue_row_tile_table(const int32_t* group_sizes, int64_t num_groups, int64_t m, int tile_rows,
                              char* base, void* zero_out, int64_t row_vecs, int sm_count, cudaStream_t stream,
                              RowTileTable* table);

}  // namespace detail
}  // namespace cuda
}  // namespace moe_xla

#endif  // MOE_XLA_CUDA_ROW_TILES_H_
