// Dispatcher of the CUDA grouped products: validation, path selection, workspace layout,
// the group-offset scan and the small zeroing kernels. The heavy kernels live in
// fallback_gemm.cu (SIMT) and cutlass_*.cu (one CUTLASS instantiation per file).
#include "cuda/grouped_gemm.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "common/grouped_gemm.h"
#include "cuda/grouped_gemm_internal.h"

namespace moe_xla {
namespace cuda {
namespace {

using detail::align_up;
using detail::CutlassGroupedArgs;
using detail::kWorkspaceAlign;
using detail::TileConfig;

constexpr int kScanThreads = 1024;

// offsets[0] = 0, offsets[g+1] = min(M, sum_{i<=g} max(group_sizes[i], 0)).
// This equals the sequential clamp of common/grouped_gemm.h:
//   start_{g+1} = start_g + clamp(size_g, 0, M - start_g)
// (by induction: min(min(M, P_g) + s, M) = min(P_g + s, M) for s >= 0).
// One block, chunks of kScanThreads groups with a running carry; G is at most a few
// thousand in practice, and the loop keeps any G correct.
__global__ void __launch_bounds__(kScanThreads)
    group_offsets_kernel(const int32_t* __restrict__ group_sizes, int64_t num_groups,
                         int64_t m, int64_t* __restrict__ offsets) {
  __shared__ int64_t warp_totals[kScanThreads / 32];
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  constexpr int kWarps = kScanThreads / 32;
  if (tid == 0) offsets[0] = 0;
  int64_t carry = 0;
  for (int64_t base = 0; base < num_groups; base += kScanThreads) {
    const int64_t i = base + tid;
    int64_t v = 0;
    if (i < num_groups) {
      const int32_t s = group_sizes[i];
      v = s > 0 ? s : 0;
    }
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const int64_t up = __shfl_up_sync(0xffffffffu, v, d);
      if (lane >= d) v += up;
    }
    if (lane == 31) warp_totals[warp] = v;
    __syncthreads();
    if (warp == 0) {
      int64_t w = warp_totals[lane];  // kWarps == 32
#pragma unroll
      for (int d = 1; d < 32; d <<= 1) {
        const int64_t up = __shfl_up_sync(0xffffffffu, w, d);
        if (lane >= d) w += up;
      }
      warp_totals[lane] = w;  // inclusive over warps
    }
    __syncthreads();
    const int64_t inclusive = carry + v + (warp > 0 ? warp_totals[warp - 1] : 0);
    if (i < num_groups) offsets[i + 1] = inclusive < m ? inclusive : m;
    carry += warp_totals[kWarps - 1];
    __syncthreads();  // warp_totals is rewritten by the next chunk
  }
}
static_assert(kScanThreads == 32 * 32, "the two-level warp scan assumes 32 warps");

// The zeroing kernels run after CUTLASS only, where the output is 16-bit, 16-byte aligned
// and K % 8 == N % 8 == 0: every range they clear is a whole number of 16-byte vectors
// (`row_vecs` = N / 8, `block_vecs` = K * N / 8), so they store uint4 zeros.

// gmm: rows [offsets[G], M) belong to no group and must be zero.
__global__ void zero_uncovered_rows_kernel(uint4* __restrict__ out,
                                           const int64_t* __restrict__ covered_rows, int64_t m,
                                           int64_t row_vecs) {
  const int64_t begin = *covered_rows * row_vecs, end = m * row_vecs;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = begin + static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < end;
       i += stride) {
    out[i] = uint4{0u, 0u, 0u, 0u};
  }
}

// tgmm: out[g] of empty groups must be zero (CUTLASS gives them no tiles).
__global__ void zero_empty_groups_kernel(uint4* __restrict__ out,
                                         const int64_t* __restrict__ offsets, int64_t num_groups,
                                         int64_t block_vecs) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t g = blockIdx.y; g < num_groups; g += gridDim.y) {
    if (offsets[g + 1] != offsets[g]) continue;
    uint4* o = out + g * block_vecs;
    for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < block_vecs;
         i += stride) {
      o[i] = uint4{0u, 0u, 0u, 0u};
    }
  }
}

size_t dtype_bytes(DType d) { return d == DType::kF32 ? 4 : 2; }

bool valid_dtype(DType d) {
  return d == DType::kF32 || d == DType::kBF16 || d == DType::kF16;
}

bool valid_layout(GroupedLayout l) {
  return l == GroupedLayout::kGmm || l == GroupedLayout::kGmmTransposed ||
         l == GroupedLayout::kTgmm;
}

bool aligned16(const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15u) == 0; }

int64_t out_elements(const GroupedGemmParams& p) {
  return p.layout == GroupedLayout::kTgmm ? p.num_groups * p.k * p.n : p.m * p.n;
}

// Sizes that keep every int64 index product in range (elements < 2^62 per array).
bool sizes_in_range(const GroupedGemmParams& p) {
  constexpr int64_t kMaxDim = int64_t{1} << 40;
  if (p.m < 0 || p.k < 0 || p.n < 0 || p.num_groups < 0) return false;
  if (p.m > kMaxDim || p.k > kMaxDim || p.n > kMaxDim || p.num_groups > kMaxDim) return false;
  __int128 lhs = static_cast<__int128>(p.m) * p.k;
  __int128 rhs = p.layout == GroupedLayout::kTgmm ? static_cast<__int128>(p.m) * p.n
                                                  : static_cast<__int128>(p.num_groups) * p.k * p.n;
  __int128 out = p.layout == GroupedLayout::kTgmm ? static_cast<__int128>(p.num_groups) * p.k * p.n
                                                  : static_cast<__int128>(p.m) * p.n;
  constexpr __int128 kMaxElems = static_cast<__int128>(1) << 62;
  return lhs < kMaxElems && rhs < kMaxElems && out < kMaxElems;
}

// Whether a CUTLASS tile configuration can compute this product.
bool cutlass_supported(const GroupedGemmParams& p, TileConfig tile) {
  if (!valid_layout(p.layout) || !sizes_in_range(p)) return false;
  if (p.in_dtype != p.out_dtype) return false;
  if (p.in_dtype == DType::kF16) {
    if (tile != TileConfig::kLarge) return false;  // only one f16 instantiation
  } else if (p.in_dtype != DType::kBF16) {
    return false;
  }
  if (p.m <= 0 || p.k <= 0 || p.n <= 0 || p.num_groups <= 0) return false;
  if (p.m > INT32_MAX || p.k > INT32_MAX || p.n > INT32_MAX || p.num_groups > INT32_MAX) {
    return false;
  }
  // TMA: 16-byte aligned base addresses and leading dimensions (8 elements of 16 bits).
  // Group offsets move the bases by whole rows of K or N elements, which keeps them aligned.
  if (p.k % 8 != 0 || p.n % 8 != 0) return false;
  return aligned16(p.lhs) && aligned16(p.rhs) && aligned16(p.out);
}

TileConfig tile_of(GroupedGemmPath path) {
  return path == GroupedGemmPath::kCutlassSmall ? TileConfig::kSmall : TileConfig::kLarge;
}

bool is_cutlass(GroupedGemmPath path) {
  return path == GroupedGemmPath::kCutlassSmall || path == GroupedGemmPath::kCutlassLarge;
}

// Calls f.template operator()<kDType, kLayout, kTile>() for the runtime combination; false if
// it was not instantiated.
template <typename F>
bool with_cutlass_config(DType d, GroupedLayout l, TileConfig t, F&& f) {
  using L = GroupedLayout;
  using T = TileConfig;
  if (d == DType::kBF16) {
    if (t == T::kSmall) {
      if (l == L::kGmm) return f.template operator()<DType::kBF16, L::kGmm, T::kSmall>(), true;
      if (l == L::kGmmTransposed)
        return f.template operator()<DType::kBF16, L::kGmmTransposed, T::kSmall>(), true;
      if (l == L::kTgmm) return f.template operator()<DType::kBF16, L::kTgmm, T::kSmall>(), true;
    } else {
      if (l == L::kGmm) return f.template operator()<DType::kBF16, L::kGmm, T::kLarge>(), true;
      if (l == L::kGmmTransposed)
        return f.template operator()<DType::kBF16, L::kGmmTransposed, T::kLarge>(), true;
      if (l == L::kTgmm) return f.template operator()<DType::kBF16, L::kTgmm, T::kLarge>(), true;
    }
  } else if (d == DType::kF16 && t == T::kLarge) {
    if (l == L::kGmm) return f.template operator()<DType::kF16, L::kGmm, T::kLarge>(), true;
    if (l == L::kGmmTransposed)
      return f.template operator()<DType::kF16, L::kGmmTransposed, T::kLarge>(), true;
    if (l == L::kTgmm) return f.template operator()<DType::kF16, L::kTgmm, T::kLarge>(), true;
  }
  return false;
}

struct CutlassWorkspaceBytes {
  int64_t groups;
  int sm_count;
  size_t* result;
  template <DType D, GroupedLayout L, TileConfig T>
  void operator()() const {
    *result = detail::cutlass_grouped_workspace_bytes<D, L, T>(groups, sm_count);
  }
};

struct CutlassRun {
  const CutlassGroupedArgs* args;
  const char** result;
  template <DType D, GroupedLayout L, TileConfig T>
  void operator()() const {
    *result = detail::cutlass_grouped_run<D, L, T>(*args);
  }
};

GroupedGemmPath resolve_path(const GroupedGemmParams& p, int sm_count, GroupedGemmPath path) {
  return path == GroupedGemmPath::kAuto ? grouped_gemm_select_path(p, sm_count) : path;
}

size_t offsets_bytes(int64_t num_groups) {
  return align_up(static_cast<size_t>(num_groups + 1) * sizeof(int64_t), kWorkspaceAlign);
}

}  // namespace

const char* grouped_gemm_path_name(GroupedGemmPath path) {
  switch (path) {
    case GroupedGemmPath::kAuto:
      return "auto";
    case GroupedGemmPath::kFallback:
      return "fallback";
    case GroupedGemmPath::kCutlassSmall:
      return "cutlass_small";
    case GroupedGemmPath::kCutlassLarge:
      return "cutlass_large";
  }
  return "unknown";
}

bool grouped_gemm_path_supported(const GroupedGemmParams& p, GroupedGemmPath path) {
  switch (path) {
    case GroupedGemmPath::kAuto:
    case GroupedGemmPath::kFallback:
      return true;
    case GroupedGemmPath::kCutlassSmall:
    case GroupedGemmPath::kCutlassLarge:
      return cutlass_supported(p, tile_of(path));
  }
  return false;
}

// Heuristic (bf16; f16 has only the large configuration):
//  - gmm: small tiles when the average group has <= 128 rows (M / G) or N <= 128, as large
//    128-row tiles (rounded up to 256 rows by the 2x1 cluster) would be mostly padding;
//    large tiles otherwise (higher wgmma efficiency, B multicast).
//  - tgmm: every group's output block is K x N whatever its rows, so the tile count is
//    known: small tiles when K or N <= 128, or when the large tiles would not fill one wave
//    of the SMs (G * ceil(K/128) * ceil(N/256) < sm_count); large tiles otherwise.
GroupedGemmPath grouped_gemm_select_path(const GroupedGemmParams& p, int sm_count) {
  if (!cutlass_supported(p, TileConfig::kLarge)) return GroupedGemmPath::kFallback;
  if (!cutlass_supported(p, TileConfig::kSmall)) return GroupedGemmPath::kCutlassLarge;
  bool small;
  if (p.layout == GroupedLayout::kTgmm) {
    const int64_t large_tiles = p.num_groups * ((p.k + 127) / 128) * ((p.n + 255) / 256);
    small = p.k <= 128 || p.n <= 128 || large_tiles < std::max(sm_count, 1);
  } else {
    const int64_t avg_rows = p.m / p.num_groups;
    small = avg_rows <= 128 || p.n <= 128;
  }
  return small ? GroupedGemmPath::kCutlassSmall : GroupedGemmPath::kCutlassLarge;
}

size_t grouped_gemm_workspace_bytes(const GroupedGemmParams& p, int sm_count,
                                    GroupedGemmPath path) {
  if (!valid_layout(p.layout) || !sizes_in_range(p)) return 0;
  size_t bytes = kWorkspaceAlign /* slack to align the base */ + offsets_bytes(p.num_groups);
  path = resolve_path(p, sm_count, path);
  if (is_cutlass(path) && cutlass_supported(p, tile_of(path))) {
    size_t cutlass_bytes = 0;
    with_cutlass_config(p.in_dtype, p.layout, tile_of(path),
                        CutlassWorkspaceBytes{p.num_groups, std::max(sm_count, 1), &cutlass_bytes});
    bytes += align_up(cutlass_bytes, kWorkspaceAlign);
  }
  return bytes;
}

size_t grouped_gemm_workspace_bytes_bound(int64_t num_groups, int max_sm_count) {
  if (num_groups < 0) return 0;
  size_t cutlass_bytes = 0;
  for (DType d : {DType::kBF16, DType::kF16}) {
    for (GroupedLayout l :
         {GroupedLayout::kGmm, GroupedLayout::kGmmTransposed, GroupedLayout::kTgmm}) {
      for (TileConfig t : {TileConfig::kSmall, TileConfig::kLarge}) {
        size_t bytes = 0;
        with_cutlass_config(d, l, t,
                            CutlassWorkspaceBytes{num_groups, std::max(max_sm_count, 1), &bytes});
        cutlass_bytes = std::max(cutlass_bytes, bytes);
      }
    }
  }
  return kWorkspaceAlign + offsets_bytes(num_groups) + align_up(cutlass_bytes, kWorkspaceAlign);
}

const char* grouped_gemm(const GroupedGemmParams& p, void* workspace, size_t workspace_bytes,
                         int sm_count, cudaStream_t stream, GroupedGemmPath path) {
  if (!valid_layout(p.layout)) return "moe_xla grouped_gemm: invalid layout";
  if (!valid_dtype(p.in_dtype) || !valid_dtype(p.out_dtype)) {
    return "moe_xla grouped_gemm: invalid dtype (expected f32, bf16 or f16)";
  }
  if (p.m < 0 || p.k < 0 || p.n < 0 || p.num_groups < 0) {
    return "moe_xla grouped_gemm: negative dimension";
  }
  if (!sizes_in_range(p)) return "moe_xla grouped_gemm: dimensions too large";
  if (sm_count <= 0) return "moe_xla grouped_gemm: sm_count must be positive";

  const int64_t out_elems = out_elements(p);
  if (out_elems == 0) return nullptr;  // nothing to write
  if (p.out == nullptr) return "moe_xla grouped_gemm: null output pointer";
  const size_t out_bytes = static_cast<size_t>(out_elems) * dtype_bytes(p.out_dtype);

  // Products that are zero without reading any input (no group has a row or K is empty).
  const bool all_zero =
      p.layout == GroupedLayout::kTgmm ? p.m == 0 : (p.num_groups == 0 || p.k == 0);
  if (all_zero) {
    if (cudaMemsetAsync(p.out, 0, out_bytes, stream) != cudaSuccess) {
      return "moe_xla grouped_gemm: cudaMemsetAsync failed";
    }
    return nullptr;
  }
  if (p.lhs == nullptr || p.rhs == nullptr) return "moe_xla grouped_gemm: null input pointer";
  if (p.group_sizes == nullptr) return "moe_xla grouped_gemm: null group_sizes pointer";

  path = resolve_path(p, sm_count, path);
  if (!grouped_gemm_path_supported(p, path)) {
    return "moe_xla grouped_gemm: the requested path does not support these dtypes, shapes or "
           "alignments";
  }
  const size_t needed = grouped_gemm_workspace_bytes(p, sm_count, path);
  if (workspace == nullptr || workspace_bytes < needed) {
    return "moe_xla grouped_gemm: workspace missing or smaller than grouped_gemm_workspace_bytes";
  }

  // Carve the workspace: [align] offsets | path-specific region.
  const uintptr_t raw = reinterpret_cast<uintptr_t>(workspace);
  const uintptr_t aligned =
      (raw + kWorkspaceAlign - 1) & ~static_cast<uintptr_t>(kWorkspaceAlign - 1);
  char* base = reinterpret_cast<char*>(aligned);
  const size_t usable = workspace_bytes - (aligned - raw);
  int64_t* offsets = reinterpret_cast<int64_t*>(base);
  const size_t off_bytes = offsets_bytes(p.num_groups);

  group_offsets_kernel<<<1, kScanThreads, 0, stream>>>(p.group_sizes, p.num_groups, p.m, offsets);
  if (cudaGetLastError() != cudaSuccess) {
    return "moe_xla grouped_gemm: launching the group offset scan failed";
  }

  if (path == GroupedGemmPath::kFallback) {
    return detail::fallback_grouped_run(p, offsets, stream);
  }

  CutlassGroupedArgs args{&p, offsets, base + off_bytes, usable - off_bytes, sm_count, stream};
  const char* err = "moe_xla grouped_gemm: no CUTLASS instantiation for this configuration";
  with_cutlass_config(p.in_dtype, p.layout, tile_of(path), CutlassRun{&args, &err});
  if (err != nullptr) return err;

  // Zero what CUTLASS leaves unwritten (16-bit output, whole 16-byte vectors, see above).
  constexpr int kZeroThreads = 256;
  constexpr int64_t kPerVec = 8;
  uint4* out_vecs = static_cast<uint4*>(p.out);
  if (p.layout == GroupedLayout::kTgmm) {
    const int64_t block_vecs = p.k * p.n / kPerVec;
    const int64_t x = std::min<int64_t>((block_vecs + kZeroThreads - 1) / kZeroThreads, 32);
    const dim3 grid(static_cast<unsigned>(x),
                    static_cast<unsigned>(std::min<int64_t>(p.num_groups, 65535)));
    zero_empty_groups_kernel<<<grid, kZeroThreads, 0, stream>>>(out_vecs, offsets, p.num_groups,
                                                                block_vecs);
  } else {
    const int64_t vecs = out_elems / kPerVec;
    const int64_t blocks =
        std::min<int64_t>((vecs + kZeroThreads - 1) / kZeroThreads, 8 * int64_t{sm_count});
    zero_uncovered_rows_kernel<<<static_cast<unsigned>(blocks), kZeroThreads, 0, stream>>>(
        out_vecs, offsets + p.num_groups, p.m, p.n / kPerVec);
  }
  if (cudaGetLastError() != cudaSuccess) {
    return "moe_xla grouped_gemm: launching the zeroing kernel failed";
  }
  return nullptr;
}

}  // namespace cuda
}  // namespace moe_xla
