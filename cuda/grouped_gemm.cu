// Dispatcher of the CUDA grouped products: validation, device check, path selection,
// workspace layout, the group-offset scan of the SIMT path and the zeroing of tgmm's empty
// groups. The heavy kernels live in fallback_gemm.cu (SIMT), cutlass_grouped.cuh (one
// CUTLASS instantiation per compilation of cutlass_instance.cu) and
// resident_b_gemm_kernel.cuh (ours, for gmm with a short K).
#include "cuda/grouped_gemm.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>

#include "common/grouped_gemm.h"
#include "common/status.h"
#include "cuda/device.h"
#include "cuda/group_offsets.cuh"
#include "cuda/grouped_gemm_internal.h"
#include "cuda/resident_b_gemm_internal.h"
#include "cuda/row_tiles.h"

namespace moe_xla {
namespace cuda {
namespace {

using detail::align_up;
using detail::CutlassGroupedArgs;
using detail::kWorkspaceAlign;
using detail::kScanThreads;
using detail::TileConfig;

// Offsets for the SIMT path (see scan_group_offsets); the CUTLASS path computes them in
// its prep kernel.
__global__ void __launch_bounds__(kScanThreads)
    group_offsets_kernel(const int32_t* __restrict__ group_sizes, int64_t num_groups,
                         int64_t m, int64_t* __restrict__ offsets) {
  detail::scan_group_offsets(group_sizes, num_groups, m, offsets,
                             [](int64_t, int64_t, int64_t) {});
}

// tgmm: out[g] of empty groups must be zero (CUTLASS gives them no tiles). Runs after
// CUTLASS only (16-bit output, 16-byte aligned, K % 8 == N % 8 == 0), so it clears whole
// 16-byte vectors, block_vecs = K * N / 8 per group.
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

// The CUTLASS instantiations of the table in cuda/BUILD.bazel: a path can run a product
// when its (dtype, layout, tile) is listed here.
struct CutlassInstance {
  DType dtype;
  GroupedLayout layout;
  TileConfig tile;
  size_t (*workspace_bytes)(int64_t num_groups, int sm_count);
  Status (*run)(const CutlassGroupedArgs& args);
};

#define MOE_XLA_CUTLASS_INSTANCE(DTYPE, LAYOUT, TILE)                                        \
  CutlassInstance{                                                                           \
      DType::DTYPE, GroupedLayout::LAYOUT, TileConfig::TILE,                                 \
      &detail::cutlass_grouped_workspace_bytes<DType::DTYPE, GroupedLayout::LAYOUT,          \
                                               TileConfig::TILE>,                            \
      &detail::cutlass_grouped_run<DType::DTYPE, GroupedLayout::LAYOUT, TileConfig::TILE>},

constexpr CutlassInstance kCutlassInstances[] = {
// One MOE_XLA_CUTLASS_INSTANCE(dtype, layout, tile) line per entry of the table, written
// by the build (cutlass_instances in bazel/cuda.bzl).
#include "cuda/grouped_gemm_cutlass.inc"
};
#undef MOE_XLA_CUTLASS_INSTANCE

const CutlassInstance* find_cutlass_instance(DType d, GroupedLayout l, TileConfig t) {
  for (const CutlassInstance& inst : kCutlassInstances) {
    if (inst.dtype == d && inst.layout == l && inst.tile == t) return &inst;
  }
  return nullptr;
}

// The instantiations of our short-K gmm kernel (resident_b_gemm_kernel.cuh), from the
// table of cuda/BUILD.bazel like the CUTLASS ones.
struct ResidentInstance {
  DType dtype;
  Status (*run)(const detail::ResidentBLaunch& launch);
};

#define MOE_XLA_CUTLASS_INSTANCE(DTYPE) \
  ResidentInstance{DType::DTYPE, &detail::resident_b_gemm_run<DType::DTYPE>},

constexpr ResidentInstance kResidentInstances[] = {
#include "cuda/resident_b_gemm_kernels.inc"
};
#undef MOE_XLA_CUTLASS_INSTANCE

// The tile configuration of a CUTLASS path; false for the others.
bool tile_of(GroupedGemmPath path, TileConfig* tile) {
  switch (path) {
    case GroupedGemmPath::kCutlassSmall:
      *tile = TileConfig::kSmall;
      return true;
    case GroupedGemmPath::kCutlassLarge:
      *tile = TileConfig::kLarge;
      return true;
    case GroupedGemmPath::kCutlassCoop128x256Cluster1x1:
      *tile = TileConfig::kCoop128x256Cluster1x1;
      return true;
    case GroupedGemmPath::kCutlassCoop128x256Cluster1x2:
      *tile = TileConfig::kCoop128x256Cluster1x2;
      return true;
    case GroupedGemmPath::kCutlassPingpong64x256Cluster2x1:
      *tile = TileConfig::kPingpong64x256Cluster2x1;
      return true;
    case GroupedGemmPath::kAuto:
    case GroupedGemmPath::kFallback:
    case GroupedGemmPath::kResidentB64x256:
      return false;
  }
  return false;
}

// The instantiation that computes this product on a CUTLASS path, or nullptr when the path
// is not a CUTLASS one or cannot compute it (dtype/layout not instantiated, shapes,
// alignment).
const CutlassInstance* cutlass_instance_for(const GroupedGemmParams& p, GroupedGemmPath path) {
  TileConfig tile;
  if (!tile_of(path, &tile)) return nullptr;
  if (!valid_layout(p.layout) || !sizes_in_range(p)) return nullptr;
  if (p.in_dtype != p.out_dtype) return nullptr;
  const CutlassInstance* inst = find_cutlass_instance(p.in_dtype, p.layout, tile);
  if (inst == nullptr) return nullptr;
  if (p.m <= 0 || p.k <= 0 || p.n <= 0 || p.num_groups <= 0) return nullptr;
  if (p.m > INT32_MAX || p.k > INT32_MAX || p.n > INT32_MAX || p.num_groups > INT32_MAX) {
    return nullptr;
  }
  // TMA: 16-byte aligned base addresses and leading dimensions (8 elements of 16 bits).
  // Group offsets move the bases by whole rows of K or N elements, which keeps them aligned.
  if (p.k % 8 != 0 || p.n % 8 != 0) return nullptr;
  if (!aligned16(p.lhs) || !aligned16(p.rhs) || !aligned16(p.out)) return nullptr;
  return inst;
}

bool cutlass_supported(const GroupedGemmParams& p, GroupedGemmPath path) {
  return cutlass_instance_for(p, path) != nullptr;
}

// The instantiation of our short-K kernel that computes this product, or nullptr: gmm
// (rhs [G, K, N]) with the same input and output dtype, 0 < K <= kResidentMaxK, and the
// TMA requirements of the CUTLASS paths (16-byte aligned bases and rows).
const ResidentInstance* resident_instance_for(const GroupedGemmParams& p) {
  if (p.layout != GroupedLayout::kGmm || !sizes_in_range(p) || p.in_dtype != p.out_dtype) return nullptr;
  if (p.m <= 0 || p.k <= 0 || p.n <= 0 || p.num_groups <= 0) return nullptr;
  // Row and column indices of a unit's tile (row_begin + 2048, col0 + 256) stay in int32.
  if (p.m > INT32_MAX - detail::kResidentUnitRows || p.n > INT32_MAX - detail::kResidentTileN ||
      p.num_groups > INT32_MAX || p.k > detail::kResidentMaxK) {
    return nullptr;
  }
  if (p.k % 8 != 0 || p.n % 8 != 0) return nullptr;
  if (!aligned16(p.lhs) || !aligned16(p.rhs) || !aligned16(p.out)) return nullptr;
  for (const ResidentInstance& inst : kResidentInstances) {
    if (inst.dtype == p.in_dtype) return &inst;
  }
  return nullptr;
}

// Bytes of the row-tile table of the short-K kernel (its units' row tiles; a multiple of
// kWorkspaceAlign).
size_t resident_table_bytes(int64_t m, int64_t num_groups) {
  return detail::row_tile_table_bytes(std::max<int64_t>(m, 0), std::max<int64_t>(num_groups, 0),
                                      detail::kResidentUnitRows);
}

// The error of a product forced onto the resident-B path that it cannot compute.
std::string resident_unsupported(const GroupedGemmParams& p) {
  const char* product = p.layout == GroupedLayout::kGmm    ? "gmm"
                        : p.layout == GroupedLayout::kTgmm ? "tgmm"
                                                           : "gmm with rhs [G, N, K]";
  return "grouped_gemm: the path resident_b64x256 needs gmm with rhs [G, K, N], bf16 in and out, 0 < K <= " +
         std::to_string(detail::kResidentMaxK) + ", K and N multiples of 8 and 16-byte aligned operands; got " +
         product + ", " + dtype_name(p.in_dtype) + " -> " + dtype_name(p.out_dtype) + ", M " + std::to_string(p.m) +
         ", K " + std::to_string(p.k) + ", N " + std::to_string(p.n);
}

// Rows per group on average from which auto takes the resident-B kernel (see select_path).
constexpr int64_t kResidentMinAverageRows = 1024;

// Output tiles of 256 columns in a row of the product's output.
int64_t column_tiles_256(const GroupedGemmParams& p) { return (p.n + 255) / 256; }

// ---------------------------------------------------------------------------------------
// Tuning heuristics: the only place that maps shapes to kernels. They were ranked with
// //tools:grouped_gemm_bench --sustain-ms 300 on an H200 (the configurations compared, and
// the figures, are in docs/performance.md); benchmark again before changing them. Ranked
// "hot": back to back, these GEMMs hold the GPU at its power cap, below its top clock, and
// that reorders configurations that a short burst on a cool GPU ranks differently.
//
// Path (bf16; f16 has only the large configuration):
//  - Small tiles (pingpong 64x128x128) when they avoid padding: gmm with <= 128 rows per
//    group on average or N <= 128; tgmm when K or N <= 128 or the large tiles would not
//    fill one wave.
//  - gmm, both rhs layouts: pingpong 64x256 cluster 2x1 when 256 < K <= 1024 (a short K
//    loop, where the epilogue, which pingpong hides behind the other warp group's
//    mainloop, is a large share of a tile); else cooperative 128x256 with A multicast over
//    a 1x2 cluster (groups padded to 128 rows, not 256 as with cluster 2x1). With K <= 256
//    a warp group's K loop is too short to hide the other's epilogue, and 128-row tiles
//    read each B tile for twice the rows. The 1x2 cluster pairs 256-column tiles, so with
//    an odd number of them it would compute a tile of zeros per row of tiles: there
//    cluster 1x1.
//  - gmm with rhs [G, K, N], 128 < K <= 256, N >= 1024 and at least 1024 rows per group on
//    average: our kernel that keeps each expert's K x 256 block of B in shared memory
//    while row tiles of up to 2048 rows pass, and stores one warp group's rows under the
//    other's wgmma (resident_b_gemm_kernel.cuh; it beats every CUTLASS configuration on the
//    sonicmoe n256 down product, K 256, N 4096). With fewer rows per group its B block would
//    be reloaded for a few rows; with N < 1024 a partial 256-column tile is a large share
//    of the work and with K <= 128 the stores are; both unmeasured, so left to CUTLASS.
//  - tgmm (ragged K): cooperative 128x256 cluster 2x1 ("large"). Pingpong 64x256 reads
//    each group's dy rows for twice as many output tiles; on the H200 the two were even
//    (geometric mean over the cases), on the H100 the cooperative kernel wins by up to 26%
//    and loses by at most 2% (docs/performance.md).
GroupedGemmPath select_path(const GroupedGemmParams& p, int sm_count) {
  if (!cutlass_supported(p, GroupedGemmPath::kCutlassLarge)) return GroupedGemmPath::kFallback;
  if (!cutlass_supported(p, GroupedGemmPath::kCutlassSmall)) return GroupedGemmPath::kCutlassLarge;
  if (p.layout == GroupedLayout::kTgmm) {
    const int64_t large_tiles = p.num_groups * ((p.k + 127) / 128) * ((p.n + 255) / 256);
    const bool small = p.k <= 128 || p.n <= 128 || large_tiles < std::max(sm_count, 1);
    return small ? GroupedGemmPath::kCutlassSmall : GroupedGemmPath::kCutlassLarge;
  }
  const int64_t avg_rows = p.m / p.num_groups;
  if (p.layout == GroupedLayout::kGmm && avg_rows >= kResidentMinAverageRows && p.k > 128 && p.n >= 1024 &&
      resident_instance_for(p) != nullptr) {
    return GroupedGemmPath::kResidentB64x256;
  }
  if (avg_rows <= 128 || p.n <= 128) return GroupedGemmPath::kCutlassSmall;
  const bool column_tile_pairs = column_tiles_256(p) % 2 == 0;
  const GroupedGemmPath tuned = p.k > 256 && p.k <= 1024 ? GroupedGemmPath::kCutlassPingpong64x256Cluster2x1
                                : column_tile_pairs        ? GroupedGemmPath::kCutlassCoop128x256Cluster1x2
                                                           : GroupedGemmPath::kCutlassCoop128x256Cluster1x1;
  return cutlass_supported(p, tuned) ? tuned : GroupedGemmPath::kCutlassLarge;
}

// Raster order (gmm, both rhs layouts): along N on the pingpong 2x1 path, and on the
// cooperative 1x1 path when a row of output tiles is short (at most 8 tiles of 256
// columns); else along M. Along N, the CTAs running together share one A row block and
// each group's B (K x N) stays in L2 while the group's row blocks pass; along M a group
// much larger than L2 has each A row block re-read once per N tile. The gain shows with
// skewed group sizes (zipf1.2: qwen3 down, N = 2048; the sonicmoe down products and the
// n256 d lhs, N = 4096, 16 tiles); with uniform sizes the two orders are even. The 1x2
// cluster already pairs tiles along N and stays along M (along N is slower there); tgmm
// stays along M.
GroupedGemmRaster select_raster(const GroupedGemmParams& p, GroupedGemmPath path,
                                int sm_count) {
  (void)sm_count;
  const bool along_n = path == GroupedGemmPath::kCutlassPingpong64x256Cluster2x1 ||
                       (path == GroupedGemmPath::kCutlassCoop128x256Cluster1x1 && column_tiles_256(p) <= 8);
  return p.layout != GroupedLayout::kTgmm && along_n ? GroupedGemmRaster::kAlongN : GroupedGemmRaster::kAlongM;
}

// Team order of the tile scheduler (team_scheduler.cuh), as {clusters per team, waves per
// block}: teams of 8 clusters in blocks of 8 waves for gmm (both rhs layouts) on the
// pingpong 64x256 2x1 path (K <= 1024) when an average group has fewer output tiles than
// the grid has clusters, else CUTLASS's order. There a tile's K loop is short, so the
// TMA descriptor rewrite at each change of group is a large share of a tile, and in
// CUTLASS's order a cluster changes group at almost every tile. Elsewhere a longer K loop
// hides the rewrite and teams only lose L2 sharing. tgmm stays in CUTLASS's order: its
// tiles' work grows with their group's rows, so a team's stretch of tiles is uneven work.
std::pair<int32_t, int32_t> select_team(const GroupedGemmParams& p, GroupedGemmPath path,
                                        int sm_count) {
  constexpr std::pair<int32_t, int32_t> kCutlassOrder{kTeamWholeGrid, 1};
  if (p.layout == GroupedLayout::kTgmm ||
      path != GroupedGemmPath::kCutlassPingpong64x256Cluster2x1 || p.num_groups <= 0) {
    return kCutlassOrder;
  }
  const int64_t row_blocks = (p.m / p.num_groups + 127) / 128;  // of the 2x1 cluster's 128 rows
  const int64_t tiles_per_group = row_blocks * column_tiles_256(p);
  return tiles_per_group < sm_count / 2 ? std::pair<int32_t, int32_t>{8, 8} : kCutlassOrder;
}
// ---------------------------------------------------------------------------------------

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
    case GroupedGemmPath::kCutlassCoop128x256Cluster1x1:
      return "cutlass_coop128x256_1x1";
    case GroupedGemmPath::kCutlassCoop128x256Cluster1x2:
      return "cutlass_coop128x256_1x2";
    case GroupedGemmPath::kCutlassPingpong64x256Cluster2x1:
      return "cutlass_pingpong64x256_2x1";
    case GroupedGemmPath::kResidentB64x256:
      return "resident_b64x256";
  }
  return "unknown";
}

const char* grouped_gemm_raster_name(GroupedGemmRaster raster) {
  switch (raster) {
    case GroupedGemmRaster::kAuto:
      return "auto";
    case GroupedGemmRaster::kAlongM:
      return "along_m";
    case GroupedGemmRaster::kAlongN:
      return "along_n";
  }
  return "unknown";
}

std::string grouped_gemm_team_name(const GroupedGemmConfig& config) {
  if (config.team_clusters == kTeamAuto || config.team_waves == kTeamAuto) return "auto";
  if (config.team_clusters == kTeamWholeGrid || config.team_waves == 1) return "grid";
  return std::to_string(config.team_clusters) + "x" + std::to_string(config.team_waves);
}

bool grouped_gemm_path_supported(const GroupedGemmParams& p, GroupedGemmPath path) {
  if (path == GroupedGemmPath::kAuto || path == GroupedGemmPath::kFallback) return true;
  if (path == GroupedGemmPath::kResidentB64x256) return resident_instance_for(p) != nullptr;
  return cutlass_supported(p, path);
}

GroupedGemmPath grouped_gemm_select_path(const GroupedGemmParams& p, int sm_count) {
  return select_path(p, sm_count);
}

GroupedGemmConfig grouped_gemm_select_config(const GroupedGemmParams& p, int sm_count,
                                             GroupedGemmConfig config) {
  if (config.path == GroupedGemmPath::kAuto) config.path = select_path(p, sm_count);
  if (config.raster == GroupedGemmRaster::kAuto) {
    config.raster = select_raster(p, config.path, sm_count);
  }
  if (config.team_clusters == kTeamAuto || config.team_waves == kTeamAuto) {
    const std::pair<int32_t, int32_t> team = select_team(p, config.path, sm_count);
    if (config.team_clusters == kTeamAuto) config.team_clusters = team.first;
    if (config.team_waves == kTeamAuto) config.team_waves = team.second;
  }
  return config;
}

size_t grouped_gemm_workspace_bytes(const GroupedGemmParams& p, int sm_count,
                                    GroupedGemmPath path) {
  if (!valid_layout(p.layout) || !sizes_in_range(p)) return 0;
  size_t bytes = kWorkspaceAlign /* slack to align the base */ + offsets_bytes(p.num_groups);
  if (path == GroupedGemmPath::kAuto) path = select_path(p, sm_count);
  if (const CutlassInstance* inst = cutlass_instance_for(p, path)) {
    bytes += align_up(inst->workspace_bytes(p.num_groups, std::max(sm_count, 1)), kWorkspaceAlign);
  }
  if (path == GroupedGemmPath::kResidentB64x256) bytes += resident_table_bytes(p.m, p.num_groups);
  return bytes;
}

size_t grouped_gemm_workspace_bytes_bound(int64_t m, int64_t num_groups, int max_sm_count) {
  if (num_groups < 0) return 0;
  size_t path_bytes = resident_table_bytes(m, num_groups);
  for (const CutlassInstance& inst : kCutlassInstances) {
    path_bytes = std::max(path_bytes,
                          align_up(inst.workspace_bytes(num_groups, std::max(max_sm_count, 1)), kWorkspaceAlign));
  }
  return kWorkspaceAlign + offsets_bytes(num_groups) + path_bytes;
}

Status grouped_gemm(const GroupedGemmParams& p, void* workspace, size_t workspace_bytes,
                    int sm_count, cudaStream_t stream, const GroupedGemmConfig& requested) {
  if (!valid_layout(p.layout)) return Status::InvalidArgument("grouped_gemm: invalid layout");
  if (!valid_dtype(p.in_dtype) || !valid_dtype(p.out_dtype)) {
    return Status::InvalidArgument("grouped_gemm: invalid dtype (expected f32, bf16 or f16)");
  }
  if (p.m < 0 || p.k < 0 || p.n < 0 || p.num_groups < 0) {
    return Status::InvalidArgument("grouped_gemm: negative dimension");
  }
  if (!sizes_in_range(p)) return Status::InvalidArgument("grouped_gemm: dimensions too large");
  if (sm_count <= 0) return Status::InvalidArgument("grouped_gemm: sm_count must be positive");
  if (requested.raster != GroupedGemmRaster::kAuto &&
      requested.raster != GroupedGemmRaster::kAlongM &&
      requested.raster != GroupedGemmRaster::kAlongN) {
    return Status::InvalidArgument("grouped_gemm: invalid raster order");
  }
  if (requested.team_clusters < 0 || requested.team_waves < 0) {
    return Status::InvalidArgument(
        "grouped_gemm: team_clusters and team_waves must be kTeamAuto (0) or positive");
  }

  // Every GPU with a kernel image runs the SIMT path; only compute capability 9.0 runs the
  // CUTLASS ones, so elsewhere the auto path is the SIMT one.
  DeviceSupport support;
  int cc_major = 0, cc_minor = 0;
  MOE_XLA_RETURN_IF_ERROR(current_device_support(&support, &cc_major, &cc_minor));
  if (support == DeviceSupport::kNone) {
    return Status::FailedPrecondition(
        device_support_error(cc_major, cc_minor, DeviceSupport::kSimt, "grouped_gemm"));
  }
  GroupedGemmConfig wanted = requested;
  if (support != DeviceSupport::kFull) {
    if (wanted.path == GroupedGemmPath::kAuto) wanted.path = GroupedGemmPath::kFallback;
    if (wanted.path != GroupedGemmPath::kFallback) {
      const std::string what =
          std::string("grouped_gemm path ") + grouped_gemm_path_name(wanted.path);
      return Status::FailedPrecondition(
          device_support_error(cc_major, cc_minor, DeviceSupport::kFull, what.c_str()));
    }
  }

  const int64_t out_elems = out_elements(p);
  if (out_elems == 0) return Status();  // nothing to write
  if (p.out == nullptr) return Status::InvalidArgument("grouped_gemm: null output pointer");
  const size_t out_bytes = static_cast<size_t>(out_elems) * dtype_bytes(p.out_dtype);

  // Products that are zero without reading any input (no group has a row or K is empty).
  const bool all_zero =
      p.layout == GroupedLayout::kTgmm ? p.m == 0 : (p.num_groups == 0 || p.k == 0);
  if (all_zero) {
    MOE_XLA_RETURN_IF_CUDA_ERROR(cudaMemsetAsync(p.out, 0, out_bytes, stream));
    return Status();
  }
  if (p.lhs == nullptr || p.rhs == nullptr) {
    return Status::InvalidArgument("grouped_gemm: null input pointer");
  }
  if (p.group_sizes == nullptr) {
    return Status::InvalidArgument("grouped_gemm: null group_sizes pointer");
  }

  const GroupedGemmConfig config = grouped_gemm_select_config(p, sm_count, wanted);
  const GroupedGemmPath path = config.path;
  if (!grouped_gemm_path_supported(p, path)) {
    if (path == GroupedGemmPath::kResidentB64x256) return Status::InvalidArgument(resident_unsupported(p));
    return Status::InvalidArgument(std::string("grouped_gemm: the path ") +
                                   grouped_gemm_path_name(path) +
                                   " does not support these dtypes, shapes or alignments");
  }
  const size_t needed = grouped_gemm_workspace_bytes(p, sm_count, path);
  if (workspace == nullptr || workspace_bytes < needed) {
    return Status::InvalidArgument("grouped_gemm: workspace of " +
                                   std::to_string(workspace == nullptr ? 0 : workspace_bytes) +
                                   " bytes, the path needs " + std::to_string(needed));
  }

  // Carve the workspace: [align] offsets | path-specific region.
  const uintptr_t raw = reinterpret_cast<uintptr_t>(workspace);
  const uintptr_t aligned =
      (raw + kWorkspaceAlign - 1) & ~static_cast<uintptr_t>(kWorkspaceAlign - 1);
  char* base = reinterpret_cast<char*>(aligned);
  const size_t usable = workspace_bytes - (aligned - raw);
  int64_t* offsets = reinterpret_cast<int64_t*>(base);
  const size_t off_bytes = offsets_bytes(p.num_groups);

  if (path == GroupedGemmPath::kFallback) {
    group_offsets_kernel<<<1, kScanThreads, 0, stream>>>(p.group_sizes, p.num_groups, p.m,
                                                        offsets);
    MOE_XLA_RETURN_IF_CUDA_ERROR(cudaGetLastError());  // launch of the offset scan
    return detail::fallback_grouped_run(p, offsets, stream).With("grouped_gemm path fallback");
  }

  if (path == GroupedGemmPath::kResidentB64x256) {
    detail::RowTileTable table;
    const int64_t row_vecs = p.n * static_cast<int64_t>(dtype_bytes(p.out_dtype)) / 16;
    MOE_XLA_RETURN_IF_ERROR(detail::enqueue_row_tile_table(p.group_sizes, p.num_groups, p.m,
                                                           detail::kResidentUnitRows, base + off_bytes, p.out,
                                                           row_vecs, sm_count, stream, &table));
    return resident_instance_for(p)
        ->run(detail::ResidentBLaunch{&p, table, sm_count, stream})
        .With(std::string("grouped_gemm path ") + grouped_gemm_path_name(path));
  }
  const CutlassInstance* inst = cutlass_instance_for(p, path);
  if (inst == nullptr) {
    return Status::Internal("grouped_gemm: no CUTLASS instantiation for this configuration");
  }
  CutlassGroupedArgs args{&p, offsets, base + off_bytes, usable - off_bytes, sm_count, stream};
  args.raster = config.raster == GroupedGemmRaster::kAlongN ? detail::RasterOrder::kAlongN
                                                            : detail::RasterOrder::kAlongM;
  args.team_clusters = config.team_clusters;
  args.team_waves = config.team_waves;
  MOE_XLA_RETURN_IF_ERROR(
      inst->run(args).With(std::string("grouped_gemm path ") + grouped_gemm_path_name(path)));
  if (p.layout != GroupedLayout::kTgmm) return Status();  // the prep kernel zeroed the rest

  constexpr int kZeroThreads = 256;
  const int64_t block_vecs = p.k * p.n / 8;
  const int64_t x = std::min<int64_t>((block_vecs + kZeroThreads - 1) / kZeroThreads, 32);
  const dim3 grid(static_cast<unsigned>(x),
                  static_cast<unsigned>(std::min<int64_t>(p.num_groups, 65535)));
  zero_empty_groups_kernel<<<grid, kZeroThreads, 0, stream>>>(static_cast<uint4*>(p.out),
                                                              offsets, p.num_groups, block_vecs);
  MOE_XLA_RETURN_IF_CUDA_ERROR(cudaGetLastError());  // launch of the zeroing kernel
  return Status();
}

}  // namespace cuda
}  // namespace moe_xla
