// Dispatcher of the FP8 blockwise grouped product (cuda/fp8_grouped_gemm.h): argument
// checks, path choice, the CUTLASS instantiations and our wgmma kernel's of the tables in
// cuda/BUILD.bazel, and the SIMT kernel that computes the contract's order exactly.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "common/fp8_blockwise.h"
#include "common/status.h"
#include "cuda/device.h"
#include "cuda/fp8_grouped_gemm.h"
#include "cuda/fp8_grouped_gemm_internal.h"
#include "cuda/fp8_wgmma_internal.h"
#include "cuda/group_offsets.cuh"
#include "cuda/row_tiles.h"

namespace moe_xla {
namespace cuda {
namespace {

using detail::align_up;
using detail::CutlassFp8Args;
using detail::Fp8TileConfig;
using detail::kFp8WgmmaTileM;
using detail::kScanThreads;
using detail::kWorkspaceAlign;

bool aligned16(const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15u) == 0; }

// Sizes that keep every int64 index product in range (elements < 2^62 per array).
bool sizes_in_range(const Fp8GroupedGemmParams& p) {
  constexpr int64_t kMaxDim = int64_t{1} << 40;
  if (p.m < 0 || p.k < 0 || p.n < 0 || p.num_groups < 0) return false;
  if (p.m > kMaxDim || p.k > kMaxDim || p.n > kMaxDim || p.num_groups > kMaxDim) return false;
  constexpr __int128 kMaxElems = static_cast<__int128>(1) << 62;
  return static_cast<__int128>(p.m) * p.k < kMaxElems && static_cast<__int128>(p.num_groups) * p.n * p.k < kMaxElems &&
         static_cast<__int128>(p.m) * p.n < kMaxElems;
}

// The CUTLASS instantiations of the FP8 table in cuda/BUILD.bazel.
struct CutlassFp8Instance {
  DType out_dtype;
  Fp8TileConfig tile;
  size_t (*workspace_bytes)(int64_t num_groups, int sm_count);
  Status (*run)(const CutlassFp8Args& args);
};

#define MOE_XLA_CUTLASS_INSTANCE(DTYPE, TILE)                                                   \
  CutlassFp8Instance{DType::DTYPE, Fp8TileConfig::TILE,                                         \
                     &detail::cutlass_fp8_workspace_bytes<DType::DTYPE, Fp8TileConfig::TILE>,   \
                     &detail::cutlass_fp8_run<DType::DTYPE, Fp8TileConfig::TILE>},

constexpr CutlassFp8Instance kCutlassFp8Instances[] = {
// One MOE_XLA_CUTLASS_INSTANCE(dtype, tile) line per entry of the table, written by the
// build (cutlass_instances in bazel/cuda.bzl).
#include "cuda/fp8_gemm_cutlass.inc"
};
#undef MOE_XLA_CUTLASS_INSTANCE

bool tile_of(Fp8GemmPath path, Fp8TileConfig* tile) {
  switch (path) {
    case Fp8GemmPath::kCutlassCoop128x128Cluster1x2: *tile = Fp8TileConfig::kCoop128x128Cluster1x2; return true;
    case Fp8GemmPath::kCutlassCoop128x128Cluster2x1: *tile = Fp8TileConfig::kCoop128x128Cluster2x1; return true;
    case Fp8GemmPath::kCutlassPingpong64x128Cluster1x1: *tile = Fp8TileConfig::kPingpong64x128Cluster1x1; return true;
    case Fp8GemmPath::kAuto:
    case Fp8GemmPath::kSimt:
    case Fp8GemmPath::kWgmma128x128:
    case Fp8GemmPath::kWgmma128x192:
    case Fp8GemmPath::kWgmma128x192Bulk: return false;
  }
  return false;
}

// Whether the TMA-fed kernels (CUTLASS's and ours) can compute this product: sizes in
// int32 (with a row tile's slack), K a multiple of 16 and N of a 16-byte output vector,
// 16-byte aligned operands and output (group offsets move the bases by whole rows, which
// keeps them aligned).
bool tma_eligible(const Fp8GroupedGemmParams& p) {
  if (!sizes_in_range(p)) return false;
  if (p.m <= 0 || p.k <= 0 || p.n <= 0 || p.num_groups <= 0) return false;
  if (p.m > INT32_MAX - kFp8WgmmaTileM || p.k > INT32_MAX || p.n > INT32_MAX || p.num_groups > INT32_MAX) return false;
  const int64_t out_vec = 16 / static_cast<int64_t>(dtype_bytes(p.out_dtype));
  if (p.k % 16 != 0 || p.n % out_vec != 0) return false;
  return aligned16(p.lhs) && aligned16(p.rhs) && aligned16(p.out);
}

// The instantiation that computes this product on a CUTLASS path, or nullptr when the path
// is not a CUTLASS one or cannot compute it (output dtype not instantiated, shapes, alignment).
const CutlassFp8Instance* cutlass_instance_for(const Fp8GroupedGemmParams& p, Fp8GemmPath path) {
  Fp8TileConfig tile;
  if (!tile_of(path, &tile) || !tma_eligible(p)) return nullptr;
  for (const CutlassFp8Instance& inst : kCutlassFp8Instances) {
    if (inst.out_dtype == p.out_dtype && inst.tile == tile) return &inst;
  }
  return nullptr;
}

// Our wgmma kernel's instantiations (the table in cuda/BUILD.bazel).
struct WgmmaFp8Instance {
  DType out_dtype;
  detail::Fp8WgmmaTile tile;
  Status (*run)(const detail::Fp8WgmmaLaunch& launch);
};

#define MOE_XLA_CUTLASS_INSTANCE(DTYPE, TILE)                        \
  WgmmaFp8Instance{DType::DTYPE, detail::Fp8WgmmaTile::TILE,         \
                   &detail::fp8_wgmma_run<DType::DTYPE, detail::Fp8WgmmaTile::TILE>},

constexpr WgmmaFp8Instance kWgmmaFp8Instances[] = {
// One MOE_XLA_CUTLASS_INSTANCE(dtype, tile) line per entry of the table, written by the
// build.
#include "cuda/fp8_wgmma_kernels.inc"
};
#undef MOE_XLA_CUTLASS_INSTANCE

// The tile of our kernel a path names, false for the other paths.
bool wgmma_tile_of(Fp8GemmPath path, detail::Fp8WgmmaTile* tile) {
  switch (path) {
    case Fp8GemmPath::kWgmma128x128: *tile = detail::Fp8WgmmaTile::kN128; return true;
    case Fp8GemmPath::kWgmma128x192: *tile = detail::Fp8WgmmaTile::kN192; return true;
    case Fp8GemmPath::kWgmma128x192Bulk: *tile = detail::Fp8WgmmaTile::kN192Bulk; return true;
    default: return false;
  }
}

bool is_wgmma_path(Fp8GemmPath path) {
  detail::Fp8WgmmaTile tile;
  return wgmma_tile_of(path, &tile);
}

// Our kernel's instantiation for this product on `path`, or nullptr when it cannot
// compute it (or `path` is not ours). Its column offsets are int32: N stays a pair of
// tiles below INT32_MAX (the last pair's second tile may lie past N).
const WgmmaFp8Instance* wgmma_instance_for(const Fp8GroupedGemmParams& p, Fp8GemmPath path) {
  detail::Fp8WgmmaTile tile;
  if (!wgmma_tile_of(path, &tile) || !tma_eligible(p)) return nullptr;
  if (p.n > INT32_MAX - 2 * static_cast<int64_t>(detail::fp8_wgmma_columns(tile))) return nullptr;
  for (const WgmmaFp8Instance& inst : kWgmmaFp8Instances) {
    if (inst.out_dtype == p.out_dtype && inst.tile == tile) return &inst;
  }
  return nullptr;
}

// Our kernel's 128 x 192 path where it pays over 128-column tiles (true, in *path), by
// the columns its clusters compute past N (pairs of 192-column tiles, the last pair's tiles
// partly or wholly past N) and K:
//   - K < 4096, where the wider tile's reuse and its store overlapping the next tile's
//     first step gain most: the staged store, at most 12% of the columns past N (qwen3
//     down, N 2048: 11%, faster). The bulk store's one stage fewer costs more than it saves.
//   - K >= 4096: the bulk store (bf16 output) at most 4% past N (mixtral gate_up 0.4%,
//     deepseek gate_up 3%: both faster than the staged store and than CUTLASS's 128-column
//     tiles), the staged one (float32) at most 2% (deepseek gate_up slower).
// benchmarks/results/LOG.md (sessions 37 and 40) has the rankings.
bool wide_path(const Fp8GroupedGemmParams& p, Fp8GemmPath* path) {
  constexpr int64_t kPair = 2 * static_cast<int64_t>(detail::fp8_wgmma_columns(detail::Fp8WgmmaTile::kN192));
  const int64_t columns = (p.n + kPair - 1) / kPair * kPair;
  const int64_t past = columns - p.n;
  if (p.k < 4096) {
    *path = Fp8GemmPath::kWgmma128x192;
    return past * 100 <= columns * 12;
  }
  if (p.out_dtype == DType::kBF16) {
    *path = Fp8GemmPath::kWgmma128x192Bulk;
    return past * 25 <= columns;
  }
  *path = Fp8GemmPath::kWgmma128x192;
  return past * 50 <= columns;
}

// Path heuristic (compute capability 9.0): pingpong 64-row tiles when an average group has
// at most 128 rows (little padding); else our kernel's 128 x 192 tiles where they pay (and
// it can compute the product), otherwise cooperative 128-row tiles with A multicast over a
// 1x2 cluster when the 128-column tiles pair up, B multicast over 2x1 otherwise.
Fp8GemmPath select_path(const Fp8GroupedGemmParams& p) {
  const bool small = p.num_groups > 0 && p.m / p.num_groups <= 128;
  Fp8GemmPath wide;
  if (!small && wide_path(p, &wide) && wgmma_instance_for(p, wide) != nullptr) return wide;
  const Fp8GemmPath tuned = small                           ? Fp8GemmPath::kCutlassPingpong64x128Cluster1x1
                            : fp8::tiles(p.n) % 2 == 0      ? Fp8GemmPath::kCutlassCoop128x128Cluster1x2
                                                            : Fp8GemmPath::kCutlassCoop128x128Cluster2x1;
  if (cutlass_instance_for(p, tuned) != nullptr) return tuned;
  for (Fp8GemmPath path : kFp8GemmPaths) {
    if (cutlass_instance_for(p, path) != nullptr) return path;
  }
  return Fp8GemmPath::kSimt;
}

// Tile order (team_scheduler.cuh): teams of 8 clusters in blocks of 8 waves on the 1x2
// cluster path when K is at most 2048 and an average group has fewer cluster units (128
// rows x 256 columns) than the grid has clusters, else CUTLASS's round robin. There a
// cluster changes group at almost every tile, and a short K loop does not hide the
// rewrite of the TMA descriptors at each change; with a long K loop, or many units per
// group, teams only lose L2 sharing (measured on the H200: LOG.md).
bool team_order_pays(const Fp8GroupedGemmParams& p, Fp8GemmPath path, int sm_count) {
  if (path != Fp8GemmPath::kCutlassCoop128x128Cluster1x2 || p.num_groups <= 0 || p.k > 2048) return false;
  const int64_t row_blocks = (p.m / p.num_groups + fp8::kTile - 1) / fp8::kTile;
  const int64_t units = row_blocks * ((fp8::tiles(p.n) + 1) / 2);
  return units < sm_count / 2;
}

size_t offsets_bytes(int64_t num_groups) {
  return align_up(static_cast<size_t>(num_groups + 1) * sizeof(int64_t), kWorkspaceAlign);
}

__global__ void __launch_bounds__(kScanThreads)
    fp8_offsets_kernel(const int32_t* __restrict__ group_sizes, int64_t num_groups, int64_t m,
                       int64_t* __restrict__ offsets) {
  detail::scan_group_offsets(group_sizes, num_groups, m, offsets, [](int64_t, int64_t, int64_t) {});
}

constexpr int kSimtThreads = fp8::kTile;  // one column per thread, one 128-deep block at a time

// SIMT path: block (x, y) computes columns [128 x, 128 x + 128) of rows y, y + gridDim.y,
// ... Per 128-deep block the row's lhs values go through shared memory; each thread sums
// its column's products in k order and adds fl(s_lhs * s_rhs) * sum with one fma: the
// contract's order, so the result is bitwise the CPU kernel's.
template <class Out>
__global__ void __launch_bounds__(kSimtThreads)
    fp8_simt_kernel(Fp8GroupedGemmParams p, const int64_t* __restrict__ offsets) {
  __shared__ float a[fp8::kTile];
  const int64_t kt = fp8::tiles(p.k), nt = fp8::tiles(p.n);
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kSimtThreads + threadIdx.x;
  Out* out = static_cast<Out*>(p.out);
  for (int64_t r = blockIdx.y; r < p.m; r += gridDim.y) {
    if (r >= offsets[p.num_groups]) {  // past the last group
      if (c < p.n) out[r * p.n + c] = Out(0.0f);
      continue;
    }
    // The group of row r: the last g with offsets[g] <= r (empty groups share offsets).
    int64_t lo = 0, hi = p.num_groups - 1;
    while (lo < hi) {
      const int64_t mid = (lo + hi + 1) / 2;
      if (offsets[mid] <= r) lo = mid; else hi = mid - 1;
    }
    const uint8_t* b = p.rhs + (lo * p.n + (c < p.n ? c : 0)) * p.k;
    const float* rhs_scales = p.rhs_scales + lo * kt * nt + (c < p.n ? c : 0) / fp8::kTile;
    float acc = 0.0f;
    for (int64_t j = 0; j < kt; ++j) {
      const int64_t k0 = j * fp8::kTile, len = p.k - k0 < fp8::kTile ? p.k - k0 : fp8::kTile;
      __syncthreads();  // the previous block's values are no longer read
      if (threadIdx.x < len) a[threadIdx.x] = fp8::fp8_e4m3_to_float(p.lhs[r * p.k + k0 + threadIdx.x]);
      __syncthreads();
      float partial = 0.0f;
      for (int64_t i = 0; i < len; ++i) partial = __fadd_rn(partial, __fmul_rn(a[i], fp8::fp8_e4m3_to_float(b[k0 + i])));
      acc = __fmaf_rn(__fmul_rn(p.lhs_scales[r * kt + j], rhs_scales[j * nt]), partial, acc);
    }
    if (c < p.n) out[r * p.n + c] = Out(acc);
  }
}

Status simt_run(const Fp8GroupedGemmParams& p, int64_t* offsets, cudaStream_t stream) {
  fp8_offsets_kernel<<<1, kScanThreads, 0, stream>>>(p.group_sizes, p.num_groups, p.m, offsets);
  MOE_XLA_RETURN_IF_CUDA_ERROR(cudaGetLastError());
  const dim3 grid(static_cast<unsigned>((p.n + kSimtThreads - 1) / kSimtThreads),
                  static_cast<unsigned>(std::min<int64_t>(p.m, 65535)));
  if (p.out_dtype == DType::kBF16) {
    fp8_simt_kernel<__nv_bfloat16><<<grid, kSimtThreads, 0, stream>>>(p, offsets);
  } else {
    fp8_simt_kernel<float><<<grid, kSimtThreads, 0, stream>>>(p, offsets);
  }
  MOE_XLA_RETURN_IF_CUDA_ERROR(cudaGetLastError());
  return Status();
}

// The error of a forced path that cannot compute the product: what the TMA-fed paths need,
// with the product's values.
Status unsupported_path(const Fp8GroupedGemmParams& p, Fp8GemmPath path) {
  const int64_t out_vec = 16 / static_cast<int64_t>(dtype_bytes(p.out_dtype));
  auto yes_no = [](bool b) { return std::string(b ? "yes" : "no"); };
  return Status::InvalidArgument(
      std::string("fp8_grouped_gemm: the path ") + fp8_gemm_path_name(path) +
      " does not support this product: it needs K a multiple of 16 (got " + std::to_string(p.k) +
      "), N a multiple of " + std::to_string(out_vec) + " (got " + std::to_string(p.n) +
      "), M, K, N and groups in int32, 16-byte aligned lhs, rhs and out (got " + yes_no(aligned16(p.lhs)) + ", " +
      yes_no(aligned16(p.rhs)) + ", " + yes_no(aligned16(p.out)) + ") and an instantiation for " +
      dtype_name(p.out_dtype) + " output");
}

}  // namespace

const char* fp8_gemm_path_name(Fp8GemmPath path) {
  switch (path) {
    case Fp8GemmPath::kAuto: return "auto";
    case Fp8GemmPath::kSimt: return "simt";
    case Fp8GemmPath::kCutlassCoop128x128Cluster1x2: return "cutlass_coop128x128_1x2";
    case Fp8GemmPath::kCutlassCoop128x128Cluster2x1: return "cutlass_coop128x128_2x1";
    case Fp8GemmPath::kCutlassPingpong64x128Cluster1x1: return "cutlass_pingpong64x128_1x1";
    case Fp8GemmPath::kWgmma128x128: return "wgmma128x128";
    case Fp8GemmPath::kWgmma128x192: return "wgmma128x192";
    case Fp8GemmPath::kWgmma128x192Bulk: return "wgmma128x192_bulk";
  }
  return "unknown";
}

bool fp8_gemm_path_supported(const Fp8GroupedGemmParams& p, Fp8GemmPath path) {
  if (path == Fp8GemmPath::kAuto || path == Fp8GemmPath::kSimt) return true;
  if (is_wgmma_path(path)) return wgmma_instance_for(p, path) != nullptr;
  return cutlass_instance_for(p, path) != nullptr;
}

Fp8GemmPath fp8_gemm_select_path(const Fp8GroupedGemmParams& p, int sm_count) {
  (void)sm_count;
  return select_path(p);
}

size_t fp8_grouped_gemm_workspace_bytes_bound(int64_t m, int64_t num_groups, int max_sm_count) {
  size_t bytes = offsets_bytes(num_groups);
  for (const CutlassFp8Instance& inst : kCutlassFp8Instances) {
    const size_t cutlass = inst.workspace_bytes(std::max<int64_t>(num_groups, 1), std::max(max_sm_count, 1));
    bytes = std::max(bytes, align_up(cutlass, kWorkspaceAlign));
  }
  const size_t table = detail::row_tile_table_bytes(std::max<int64_t>(m, 0), std::max<int64_t>(num_groups, 0), kFp8WgmmaTileM);
  return kWorkspaceAlign + std::max(bytes, table);
}

Status fp8_grouped_gemm(const Fp8GroupedGemmParams& p, void* workspace, size_t workspace_bytes, int sm_count,
                        cudaStream_t stream, Fp8GemmPath path) {
  if (p.out_dtype != DType::kBF16 && p.out_dtype != DType::kF32) {
    return Status::InvalidArgument("fp8_grouped_gemm: output dtype must be bf16 or f32, got " +
                                   std::string(dtype_name(p.out_dtype)));
  }
  if (!sizes_in_range(p)) return Status::InvalidArgument("fp8_grouped_gemm: negative or too large dimensions");
  if (sm_count <= 0) return Status::InvalidArgument("fp8_grouped_gemm: sm_count must be positive");

  DeviceSupport support;
  int cc_major = 0, cc_minor = 0;
  MOE_XLA_RETURN_IF_ERROR(current_device_support(&support, &cc_major, &cc_minor));
  if (support == DeviceSupport::kNone) {
    return Status::FailedPrecondition(device_support_error(cc_major, cc_minor, DeviceSupport::kSimt, "fp8_grouped_gemm"));
  }
  if (path == Fp8GemmPath::kAuto) path = support == DeviceSupport::kFull ? select_path(p) : Fp8GemmPath::kSimt;
  if (path != Fp8GemmPath::kSimt && support != DeviceSupport::kFull) {
    const std::string what = std::string("fp8_grouped_gemm path ") + fp8_gemm_path_name(path);
    return Status::FailedPrecondition(device_support_error(cc_major, cc_minor, DeviceSupport::kFull, what.c_str()));
  }

  const size_t out_bytes = static_cast<size_t>(p.m * p.n) * dtype_bytes(p.out_dtype);
  if (out_bytes == 0) return Status();
  if (p.out == nullptr) return Status::InvalidArgument("fp8_grouped_gemm: null output pointer");
  if (p.num_groups == 0) {  // no row belongs to a group
    MOE_XLA_RETURN_IF_CUDA_ERROR(cudaMemsetAsync(p.out, 0, out_bytes, stream));
    return Status();
  }
  if (p.lhs == nullptr || p.rhs == nullptr || p.group_sizes == nullptr ||
      (p.k > 0 && (p.lhs_scales == nullptr || p.rhs_scales == nullptr))) {
    return Status::InvalidArgument("fp8_grouped_gemm: null input pointer");
  }

  const size_t needed = fp8_grouped_gemm_workspace_bytes_bound(p.m, p.num_groups, sm_count);
  if (workspace == nullptr || workspace_bytes < needed) {
    return Status::InvalidArgument("fp8_grouped_gemm: workspace of " +
                                   std::to_string(workspace == nullptr ? 0 : workspace_bytes) +
                                   " bytes, it needs " + std::to_string(needed));
  }
  const uintptr_t raw = reinterpret_cast<uintptr_t>(workspace);
  const uintptr_t aligned = (raw + kWorkspaceAlign - 1) & ~static_cast<uintptr_t>(kWorkspaceAlign - 1);
  char* base = reinterpret_cast<char*>(aligned);
  const size_t usable = workspace_bytes - (aligned - raw);

  if (path == Fp8GemmPath::kSimt) {
    return simt_run(p, reinterpret_cast<int64_t*>(base), stream).With("fp8_grouped_gemm path simt");
  }
  if (is_wgmma_path(path)) {
    const WgmmaFp8Instance* inst = wgmma_instance_for(p, path);
    if (inst == nullptr) return unsupported_path(p, path);
    detail::RowTileTable table;
    const int64_t row_vecs = p.n * static_cast<int64_t>(dtype_bytes(p.out_dtype)) / 16;
    MOE_XLA_RETURN_IF_ERROR(detail::enqueue_row_tile_table(p.group_sizes, p.num_groups, p.m, kFp8WgmmaTileM, base,
                                                           p.out, row_vecs, sm_count, stream, &table));
    return inst->run(detail::Fp8WgmmaLaunch{&p, table, sm_count, stream})
        .With(std::string("fp8_grouped_gemm path ") + fp8_gemm_path_name(path));
  }
  const CutlassFp8Instance* inst = cutlass_instance_for(p, path);
  if (inst == nullptr) return unsupported_path(p, path);
  CutlassFp8Args args{&p, base, usable, sm_count, stream};
  if (team_order_pays(p, path, sm_count)) {
    args.team_clusters = 8;
    args.team_waves = 8;
  }
  return inst->run(args).With(std::string("fp8_grouped_gemm path ") + fp8_gemm_path_name(path));
}

}  // namespace cuda
}  // namespace moe_xla
