// Row gathers and row expansions that keep many loads in flight: the device code and
// launchers that permute's dispatch (permute.cu) and gather_rows (gather_rows.cu) share.
//
// gather:  out[r] = op_r(values[i_r]) for r < num_rows, a zero row where i_r < 0,
//
// where rows.row(r) gives (i_r, op_r): a Copy, or any type with an `index` and an
// operator() that maps one copy unit V of values to the unit stored (gather_rows' factor).
//
// expand:  out[slots[t * k + j]] = values[t] for t < num_values, j < k, slots outside
//          [0, num_rows) naming no row;
//
// each values row is read once and stored k times. Where every values row is wanted k
// times (permute's dispatch), this moves (1 + k) row sizes per values row where the gather
// moves 2 k: the gather's k reads of a row come at unrelated times and miss the L2.
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
// evict-first (st.global.cs: these kernels do not read them back). Offsets are int64.
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

// v[u] = src[base + u * team] for the units of the row (c < row_vectors), all loads
// issued before any is used.
template <typename V>
__device__ __forceinline__ void load_units(const V* src, int64_t base, int team, int64_t row_vectors,
                                           V (&v)[kUnroll]) {
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const int64_t c = base + int64_t{u} * team;
    if (c < row_vectors) v[u] = __ldg(src + c);
  }
}

template <typename V, class Rows>
__global__ void __launch_bounds__(kThreads)
    gather(const V* __restrict__ values, V* __restrict__ out, int64_t num_rows, int64_t row_vectors, int team_log2,
           Rows rows) {
  const int team = 1 << team_log2;
  const int lane = threadIdx.x & (team - 1);
  const int64_t rows_per_block = kThreads >> team_log2;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * rows_per_block;
  for (int64_t r = blockIdx.x * rows_per_block + (threadIdx.x >> team_log2); r < num_rows; r += stride) {
    const auto source = rows.row(r);
    V* dst = out + r * row_vectors;
    if (source.index < 0) {
      for (int64_t c = lane; c < row_vectors; c += team) __stcs(dst + c, V{});
      continue;
    }
    const V* src = values + source.index * row_vectors;
    for (int64_t base = lane; base < row_vectors; base += int64_t{team} * kUnroll) {
      V v[kUnroll];
      load_units(src, base, team, row_vectors, v);
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t c = base + int64_t{u} * team;
        if (c < row_vectors) __stcs(dst + c, source(v[u]));
      }
    }
  }
}

template <typename V>
__global__ void __launch_bounds__(kThreads)
    expand(const V* __restrict__ values, V* __restrict__ out, int64_t num_values, int k, int64_t num_rows,
           int64_t row_vectors, int team_log2, const int32_t* __restrict__ slots) {
  const int team = 1 << team_log2;
  const int lane = threadIdx.x & (team - 1);
  const int64_t rows_per_block = kThreads >> team_log2;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * rows_per_block;
  for (int64_t t = blockIdx.x * rows_per_block + (threadIdx.x >> team_log2); t < num_values; t += stride) {
    const V* src = values + t * row_vectors;
    const int32_t* row_slots = slots + t * k;
    for (int64_t base = lane; base < row_vectors; base += int64_t{team} * kUnroll) {
      V v[kUnroll];
      load_units(src, base, team, row_vectors, v);
      for (int j = 0; j < k; ++j) {
        const int64_t s = __ldg(row_slots + j);
        if (s < 0 || s >= num_rows) continue;
        V* dst = out + s * row_vectors;
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const int64_t c = base + int64_t{u} * team;
          if (c < row_vectors) __stcs(dst + c, v[u]);
        }
      }
    }
  }
}

// The smallest team (log2) that covers a row of row_vectors units in one pass, and the grid.
inline int team_log2_for(int64_t row_vectors) {
  int team_log2 = 0;
  while ((1 << team_log2) < kThreads && (int64_t{1} << team_log2) * kUnroll < row_vectors) ++team_log2;
  return team_log2;
}

inline unsigned blocks_for(int64_t num_rows, int team_log2) {
  const int64_t rows_per_block = kThreads >> team_log2;
  return static_cast<unsigned>(std::min((num_rows + rows_per_block - 1) / rows_per_block, kMaxBlocks));
}

template <typename V, class Rows>
cudaError_t launch_unit(const void* values, void* out, int64_t num_rows, int64_t row_bytes, const Rows& rows,
                        cudaStream_t stream) {
  const int64_t row_vectors = row_bytes / static_cast<int64_t>(sizeof(V));
  const int team_log2 = team_log2_for(row_vectors);
  gather<V, Rows><<<blocks_for(num_rows, team_log2), kThreads, 0, stream>>>(
      static_cast<const V*>(values), static_cast<V*>(out), num_rows, row_vectors, team_log2, rows);
  return cudaGetLastError();
}

template <typename V>
struct Unit {
  using type = V;
};

// fn(Unit<V>{}) for the widest copy unit V (16, 8, 4, 2 or 1 bytes, at least kMinUnit: the
// element size an op of the rows needs whole) that divides the row size and both base
// addresses; cudaErrorMisalignedAddress where kMinUnit does not divide them.
template <size_t kMinUnit, class Fn>
cudaError_t with_copy_unit(const void* values, const void* out, int64_t row_bytes, Fn&& fn) {
  const uintptr_t addresses = reinterpret_cast<uintptr_t>(values) | reinterpret_cast<uintptr_t>(out);
  auto fits = [&](size_t bytes) { return row_bytes % bytes == 0 && addresses % bytes == 0; };
  if (fits(16)) return fn(Unit<uint4>{});
  if (fits(8)) return fn(Unit<uint2>{});
  if constexpr (kMinUnit <= 4) {
    if (fits(4)) return fn(Unit<uint32_t>{});
  }
  if constexpr (kMinUnit <= 2) {
    if (fits(2)) return fn(Unit<uint16_t>{});
  }
  if constexpr (kMinUnit <= 1) return fn(Unit<uint8_t>{});
  return cudaErrorMisalignedAddress;  // kMinUnit does not divide the rows or addresses
}

// Enqueues the gather of num_rows rows of row_bytes bytes with with_copy_unit's unit.
template <size_t kMinUnit, class Rows>
cudaError_t launch(const void* values, void* out, int64_t num_rows, int64_t row_bytes, const Rows& rows,
                   cudaStream_t stream) {
  if (num_rows <= 0) return cudaSuccess;
  return with_copy_unit<kMinUnit>(values, out, row_bytes, [&](auto unit) {
    return launch_unit<typename decltype(unit)::type>(values, out, num_rows, row_bytes, rows, stream);
  });
}

// Enqueues the expansion of num_values rows of row_bytes bytes, k slots each (slots
// [num_values, k]), into out [num_rows rows], copied in the widest unit that fits.
inline cudaError_t launch_expand(const void* values, void* out, int64_t num_values, int k, int64_t num_rows,
                                 int64_t row_bytes, const int32_t* slots, cudaStream_t stream) {
  if (num_values <= 0 || k <= 0 || row_bytes <= 0) return cudaSuccess;
  return with_copy_unit<1>(values, out, row_bytes, [&](auto unit) {
    using V = typename decltype(unit)::type;
    const int64_t row_vectors = row_bytes / static_cast<int64_t>(sizeof(V));
    const int team_log2 = team_log2_for(row_vectors);
    expand<V><<<blocks_for(num_values, team_log2), kThreads, 0, stream>>>(
        static_cast<const V*>(values), static_cast<V*>(out), num_values, k, num_rows, row_vectors, team_log2, slots);
    return cudaGetLastError();
  });
}

}  // namespace row_gather
}  // namespace cuda
}  // namespace moe_xla

#endif  // MOE_XLA_CUDA_ROW_GATHER_CUH_
