// Device code shared by the grouped-GEMM kernels that turn group sizes into row offsets
// (the SIMT path's scan kernel in grouped_gemm.cu and the CUTLASS prep kernel in
// cutlass_grouped.cuh), and the zeroing of gmm rows that belong to no group.
#ifndef MOE_XLA_CUDA_GROUP_OFFSETS_CUH_
#define MOE_XLA_CUDA_GROUP_OFFSETS_CUH_

#include <cuda_runtime.h>

#include <cstdint>

namespace moe_xla {
namespace cuda {
namespace detail {

// Threads of a block that runs scan_group_offsets (32 warps: a two-level warp scan).
constexpr int kScanThreads = 1024;

// Inclusive prefix sum of one value per thread over a whole block of kThreads threads (a
// multiple of 32, at most 1024; a two-level warp scan); the block's total goes to `total`.
// Every thread of the block must call it (it synchronises the block twice).
template <int kThreads = kScanThreads>
__device__ __forceinline__ int64_t block_inclusive_scan(int64_t v, int64_t* total) {
  constexpr int kWarps = kThreads / 32;
  static_assert(kThreads % 32 == 0 && kWarps <= 32, "the two-level warp scan takes 1 .. 32 whole warps");
  __shared__ int64_t warp_totals[kWarps];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const int64_t up = __shfl_up_sync(0xffffffffu, v, d);
    if (lane >= d) v += up;
  }
  if (lane == 31) warp_totals[warp] = v;
  __syncthreads();
  if (warp == 0) {
    int64_t w = lane < kWarps ? warp_totals[lane] : 0;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const int64_t up = __shfl_up_sync(0xffffffffu, w, d);
      if (lane >= d) w += up;
    }
    if (lane < kWarps) warp_totals[lane] = w;  // inclusive over warps
  }
  __syncthreads();
  const int64_t inclusive = v + (warp > 0 ? warp_totals[warp - 1] : 0);
  *total = warp_totals[kWarps - 1];
  __syncthreads();  // warp_totals is rewritten by the next call
  return inclusive;
}

// Row offsets of the groups, computed by one whole block of kScanThreads threads:
//   start_g = min(M, P_g), end_g = min(M, P_{g+1}),  P_g = sum_{i<g} max(group_sizes[i], 0).
// This equals the sequential clamp of common/grouped_gemm.h,
//   start_{g+1} = start_g + clamp(size_g, 0, M - start_g),
// by induction: min(min(M, P) + s, M) = min(P + s, M) for s >= 0.
// For every group, the thread that owns it calls visit(g, start_g, end_g); when `offsets`
// is not null it also stores offsets[0] = 0 and offsets[g + 1] = end_g. Groups go in
// chunks of kScanThreads with a running carry, so any G is correct. Returns end_{G-1}
// (the rows covered by groups, 0 when G = 0) to every thread.
template <class Visit>
__device__ __forceinline__ int64_t scan_group_offsets(const int32_t* __restrict__ group_sizes,
                                                      int64_t num_groups, int64_t m,
                                                      int64_t* __restrict__ offsets,
                                                      Visit&& visit) {
  if (offsets != nullptr && threadIdx.x == 0) offsets[0] = 0;
  int64_t carry = 0;
  for (int64_t base = 0; base < num_groups; base += kScanThreads) {
    const int64_t g = base + threadIdx.x;
    int64_t size = 0;
    if (g < num_groups) {
      const int32_t s = group_sizes[g];
      size = s > 0 ? s : 0;
    }
    int64_t chunk = 0;
    const int64_t inclusive = carry + block_inclusive_scan(size, &chunk);
    if (g < num_groups) {
      const int64_t end = inclusive < m ? inclusive : m;
      const int64_t exclusive = inclusive - size;
      const int64_t start = exclusive < m ? exclusive : m;
      if (offsets != nullptr) offsets[g + 1] = end;
      visit(g, start, end);
    }
    carry += chunk;
  }
  return carry < m ? carry : m;
}

// The tiles of `tile_rows` rows of the groups (128 for common/fp8_blockwise.h's
// Fp8GroupColsParams): with the rows of scan_group_offsets, group g holds tiles
// [first_g, first_g + ceil((end_g - start_g) / tile_rows)), first_g the sum of the tile
// counts of the groups before it. Run by a whole block of kThreads threads; the owner
// thread of every group calls visit(g, start_g, end_g, first_g). Returns to every thread
// the covered rows and, in *group_tiles, the tiles of all groups (the rows past the
// groups are the last segment, whose tiles start there).
template <int kThreads, class Visit>
__device__ __forceinline__ int64_t scan_group_tiles(const int32_t* __restrict__ group_sizes, int64_t num_groups,
                                                    int64_t m, int64_t tile_rows, int64_t* group_tiles,
                                                    Visit&& visit) {
  int64_t row_carry = 0, tile_carry = 0;
  for (int64_t base = 0; base < num_groups; base += kThreads) {
    const int64_t g = base + threadIdx.x;
    int64_t size = 0;
    if (g < num_groups) {
      const int32_t s = group_sizes[g];
      size = s > 0 ? s : 0;
    }
    int64_t rows_chunk = 0, tiles_chunk = 0;
    const int64_t inclusive = row_carry + block_inclusive_scan<kThreads>(size, &rows_chunk);
    const int64_t end = inclusive < m ? inclusive : m;
    const int64_t start = inclusive - size < m ? inclusive - size : m;
    const int64_t tiles = g < num_groups ? (end - start + tile_rows - 1) / tile_rows : 0;
    const int64_t first = tile_carry + block_inclusive_scan<kThreads>(tiles, &tiles_chunk) - tiles;
    if (g < num_groups) visit(g, start, end, first);
    row_carry += rows_chunk;
    tile_carry += tiles_chunk;
  }
  *group_tiles = tile_carry;
  return row_carry < m ? row_carry : m;
}

// gmm: rows [covered, M) of out [M, N] belong to no group and must be zero. The whole
// grid strides over them in 16-byte vectors (16-bit output, N % 8 == 0, 16-byte aligned:
// what the CUTLASS path requires; row_vecs = N / 8).
__device__ __forceinline__ void zero_rows_from(uint4* __restrict__ out, int64_t covered,
                                               int64_t m, int64_t row_vecs) {
  const int64_t end = m * row_vecs;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = covered * row_vecs + static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       i < end; i += stride) {
    out[i] = uint4{0u, 0u, 0u, 0u};
  }
}

}  // namespace detail
}  // namespace cuda
}  // namespace moe_xla

#endif  // MOE_XLA_CUDA_GROUP_OFFSETS_CUH_
