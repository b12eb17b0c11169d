// Row gathers that keep many loads in flight: the device code and launcher that permute's
// dispatch (permute.cu) and gather_rows (gather_rows.cu) share.
//
//   out[r] = op_r(values[i_r]) for r < num_rows, a zero row where i_r < 0,
//
// where rows.row(r, leader) gives (i_r, op_r): a Copy, or any type with an `index` and an
// operator() that maps one copy unit V of values to the unit stored (gather_rows' factor).
// leader is true for one thread of the row's team (permute writes its row_map there).
//
// Launch shape: a team of 2^team_log2 threads per row (up to the kThreads of a block) and
// kThreads / team rows per block. Each thread loads kUnroll copy units of its row into
// registers before it stores the first, so it has kUnroll independent loads in flight;
// consecutive threads of a team read consecutive units (coalesced). The team is the
// smallest that covers a row in one pass of kUnroll units per thread: short rows share a
// warp among several rows, long rows take several warps, rows of more than kThreads *
// kUnroll units take several passes. Blocks step over rows with a grid stride (the grid is
// capped at kMaxBlocks, which fills any current GPU many times over). Values are read
// through the non-coherent cache (ld.global.nc: nothing here writes them), rows stored
// evict-first (st.global.cs: this kernel does not read them back). Offsets are int64.
#ifndef MOE_XLA_CUDA_ROW_GATHER_CUH_
#define MOE_XLA_CUDA_ROW_GATHER_CUH_

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>

namespace moe_xla {
namespace cuda {
namespace row_gather {

constexpr int kThreads = 256;
constexpr int kUnroll = 4;
constexpr int64_t kMaxBlocks = int64_t{1} << 16;

// A row copied as it is from values row `index` (negative: a zero row).
struct Copy {
  int64_t index;
  template <typename V>
  __device__ __forceinline__ V operator()(V v) const {
    return v;
  }
};

template <typename V, class Rows>
__global__ void __launch_bounds__(kThreads)
    gather(const V* __restrict__ values, V* __restrict__ out, int64_t num_rows, int64_t row_vectors, int team_log2,
           Rows rows) {
  const int team = 1 << team_log2;
  const int lane = threadIdx.x & (team - 1);
  const int64_t rows_per_block = kThreads >> team_log2;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * rows_per_block;
  for (int64_t r = blockIdx.x * rows_per_block + (threadIdx.x >> team_log2); r < num_rows; r += stride) {
    const auto source = rows.row(r, lane == 0);
    V* dst = out + r * row_vectors;
    if (source.index < 0) {
      for (int64_t c = lane; c < row_vectors; c += team) __stcs(dst + c, V{});
      continue;
    }
    const V* src = values + source.index * row_vectors;
    for (int64_t base = lane; base < row_vectors; base += int64_t{team} * kUnroll) {
      V v[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t c = base + int64_t{u} * team;
        if (c < row_vectors) v[u] = __ldg(src + c);
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t c = base + int64_t{u} * team;
        if (c < row_vectors) __stcs(dst + c, source(v[u]));
      }
    }
  }
}

template <typename V, class Rows>
cudaError_t launch_unit(const void* values, void* out, int64_t num_rows, int64_t row_bytes, const Rows& rows,
                        cudaStream_t stream) {
  const int64_t row_vectors = row_bytes / static_cast<int64_t>(sizeof(V));
  int team_log2 = 0;
  while ((1 << team_log2) < kThreads && (int64_t{1} << team_log2) * kUnroll < row_vectors) ++team_log2;
  const int64_t rows_per_block = kThreads >> team_log2;
  const int64_t blocks = std::min((num_rows + rows_per_block - 1) / rows_per_block, kMaxBlocks);
  gather<V, Rows><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      static_cast<const V*>(values), static_cast<V*>(out), num_rows, row_vectors, team_log2, rows);
  return cudaGetLastError();
}

// Enqueues the gather of num_rows rows of row_bytes bytes (rows of size 0 still call
// rows.row once per row) with the widest copy unit (16, 8, 4, 2 or 1 bytes, at least
// kMinUnit: the element size an op of the rows needs whole) that divides the row size and
// both base addresses; cudaErrorMisalignedAddress where kMinUnit does not divide them.
template <size_t kMinUnit, class Rows>
cudaError_t launch(const void* values, void* out, int64_t num_rows, int64_t row_bytes, const Rows& rows,
                   cudaStream_t stream) {
  if (num_rows <= 0) return cudaSuccess;
  const uintptr_t addresses = reinterpret_cast<uintptr_t>(values) | reinterpret_cast<uintptr_t>(out);
  auto fits = [&](size_t bytes) { return row_bytes % bytes == 0 && addresses % bytes == 0; };
  if (fits(16)) return launch_unit<uint4>(values, out, num_rows, row_bytes, rows, stream);
  if (fits(8)) return launch_unit<uint2>(values, out, num_rows, row_bytes, rows, stream);
  if constexpr (kMinUnit <= 4) {
    if (fits(4)) return launch_unit<uint32_t>(values, out, num_rows, row_bytes, rows, stream);
  }
  if constexpr (kMinUnit <= 2) {
    if (fits(2)) return launch_unit<uint16_t>(values, out, num_rows, row_bytes, rows, stream);
  }
  if constexpr (kMinUnit <= 1) return launch_unit<uint8_t>(values, out, num_rows, row_bytes, rows, stream);
  return cudaErrorMisalignedAddress;  // kMinUnit does not divide the rows or addresses
}

}  // namespace row_gather
}  // namespace cuda
}  // namespace moe_xla

#endif  // MOE_XLA_CUDA_ROW_GATHER_CUH_
