// Dispatcher of the gather grouped GEMM: validation, device check, workspace layout and
// the two prep kernels that turn the group sizes into the table of row tiles the GEMM
// kernel (gather_gemm_kernel.cuh, one compilation per output dtype, layout of w and
// epilogue) walks.
#include "cuda/gather_gemm.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "common/expert_activation.h"
#include "common/gather_gemm.h"
#include "common/status.h"
#include "cuda/device.h"
#include "cuda/gather_checks.h"
#include "cuda/gather_dispatch.h"
#include "cuda/gather_gemm_internal.h"
#include "cuda/group_offsets.cuh"

namespace moe_xla {
namespace cuda {
namespace {

using detail::align_up;
using detail::aligned16;
using detail::GatherEpilogue;
using detail::GatherRowTile;
using detail::GatherTileCount;
using detail::kAlign;
using detail::kGatherMaxDim;
using detail::kGatherTileM;
using detail::kScanThreads;

constexpr int kFillThreads = 256;

// Where group g's row tiles start in the table, and its rows [start, end).
struct alignas(16) GroupTiles {
  int32_t first_tile;
  int32_t start;
  int32_t end;
  int32_t unused;
};

// Row tiles of all groups: sum_g ceil(rows_g / 128) <= ceil(M / 128) + G.
int64_t max_row_tiles(int64_t m, int64_t num_groups) {
  return (m + kGatherTileM - 1) / kGatherTileM + num_groups;
}
int64_t max_row_tiles(const GatherGemmParams& p) { return max_row_tiles(p.m, p.num_groups); }

// Offsets from an aligned base: group tiles | tile count | row-tile table.
struct WorkspaceLayout {
  size_t groups, count, row_tiles, total;
  WorkspaceLayout(int64_t m, int64_t num_groups) {
    groups = 0;
    count = align_up(static_cast<size_t>(num_groups) * sizeof(GroupTiles));
    row_tiles = count + align_up(sizeof(GatherTileCount));
    total = row_tiles + align_up(static_cast<size_t>(max_row_tiles(m, num_groups)) * sizeof(GatherRowTile));
  }
};

// One block of kScanThreads: every group's first row tile and rows (scan_group_tiles of
// group_offsets.cuh, clamped as common/gather_gemm.h says), the number of row tiles and
// the covered rows.
__global__ void __launch_bounds__(kScanThreads)
    gather_group_tiles_kernel(const int32_t* __restrict__ group_sizes, int64_t num_groups,
                              int64_t m, GroupTiles* __restrict__ groups,
                              GatherTileCount* __restrict__ count) {
  int64_t tiles = 0;
  const int64_t covered = detail::scan_group_tiles<kScanThreads>(
      group_sizes, num_groups, m, kGatherTileM, &tiles,
      [&](int64_t g, int64_t start, int64_t end, int64_t first) {
        groups[g] = GroupTiles{static_cast<int32_t>(first), static_cast<int32_t>(start),
                               static_cast<int32_t>(end), 0};
      });
  if (threadIdx.x == 0) *count = GatherTileCount{tiles, covered};
}

// The grid writes row tile i of the table for every i < count->row_tiles (its group: the
// last one whose first tile is <= i; empty groups share their first tile with the next
// group, so that one is never empty) and zeroes the output rows past the groups
// (16-byte vectors, row_vecs of them per row).
__global__ void __launch_bounds__(kFillThreads)
    gather_row_tiles_kernel(const GroupTiles* __restrict__ groups, int64_t num_groups,
                            const GatherTileCount* __restrict__ count,
                            GatherRowTile* __restrict__ row_tiles, uint4* __restrict__ out,
                            int64_t m, int64_t row_vecs) {
  const GatherTileCount c = *count;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < c.row_tiles;
       i += stride) {
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
    const int32_t begin = g.start + static_cast<int32_t>(i - g.first_tile) * kGatherTileM;
    row_tiles[i] = GatherRowTile{static_cast<int32_t>(lo), begin,
                                 std::min(begin + kGatherTileM, g.end), 0};
  }
  detail::zero_rows_from(out, c.covered, m, row_vecs);
}

// One compiled kernel: its output dtype, the layout of w (kGmm: [G, K, N];
// kGmmTransposed: [G, N, K]), its epilogue and its launcher.
struct KernelInstance {
  DType out_dtype;
  GroupedLayout layout;
  GatherEpilogue epilogue;
  Status (*run)(const detail::GatherGemmLaunch& launch);
};

#define MOE_XLA_CUTLASS_INSTANCE(OUT_DTYPE, LAYOUT, EPILOGUE)                         \
  KernelInstance{DType::OUT_DTYPE, GroupedLayout::LAYOUT, GatherEpilogue::EPILOGUE,   \
                 &detail::gather_gemm_kernel_run<DType::OUT_DTYPE, GroupedLayout::LAYOUT, \
                                                 GatherEpilogue::EPILOGUE>},

// The compiled kernels, one per (output dtype, layout, epilogue) of the instance table in
// cuda/BUILD.bazel.
constexpr KernelInstance kKernelInstances[] = {
// One MOE_XLA_CUTLASS_INSTANCE(out dtype, layout, epilogue) line per entry of the table,
// written by the build (cutlass_instances in bazel/cuda.bzl).
#include "cuda/gather_gemm_kernels.inc"
};
#undef MOE_XLA_CUTLASS_INSTANCE

// The layout of w that p names.
GroupedLayout w_layout(const GatherGemmParams& p) {
  return p.transpose_w ? GroupedLayout::kGmmTransposed : GroupedLayout::kGmm;
}

// The epilogue p asks for (common/gather_gemm.h).
GatherEpilogue epilogue(const GatherGemmParams& p) {
  if (!p.activated) return GatherEpilogue::kNone;
  return is_gated(p.activation) ? GatherEpilogue::kGated : GatherEpilogue::kPlain;
}

// Columns of out: N, or F = N / 2 for a gated activation.
int64_t out_cols(const GatherGemmParams& p) {
  return epilogue(p) == GatherEpilogue::kGated ? p.n / 2 : p.n;
}

// The kernel for p's output dtype, layout of w and epilogue, or null.
const KernelInstance* find_instance(const GatherGemmParams& p) {
  for (const KernelInstance& inst : kKernelInstances) {
    if (inst.out_dtype == p.out_dtype && inst.layout == w_layout(p) && inst.epilogue == epilogue(p)) return &inst;
  }
  return nullptr;
}

// The activation's extra requirements: w [G, K, N] and bf16 output (the compiled
// epilogues), an activation of common/expert_activation.h and, gated, N = 2F with
// F % 128 == 0 (the gate and up halves of a column tile are 128 columns each).
Status validate_activation(const GatherGemmParams& p) {
  const int32_t act = static_cast<int32_t>(p.activation);
  if (act < 0 || act >= kNumActivations) {
    return Status::InvalidArgument("gather_gemm: activation = " + std::to_string(act) + " is outside [0, " +
                                   std::to_string(kNumActivations) + ")");
  }
  if (p.transpose_w) {
    return Status::InvalidArgument("gather_gemm: an activation needs w [G, K, N], got transpose_w");
  }
  if (p.out_dtype != DType::kBF16) {
    return Status::InvalidArgument(std::string("gather_gemm: an activation needs bf16 output, got ") +
                                   dtype_name(p.out_dtype));
  }
  if (is_gated(p.activation) && p.n % 256 != 0) {
    return Status::InvalidArgument("gather_gemm: a gated activation needs n = 2F with F a multiple of 128, got n = " +
                                   std::to_string(p.n));
  }
  return Status();
}

// Shape and dtype errors that need no device: ok or an InvalidArgument naming the field.
// (Both output dtypes of the checks have an instance in both layouts, and the activation
// checks leave only its instances.) K is the row length of x, and of w when transposed
// ([G, N, K]); N that of out, and of w otherwise.
Status validate(const GatherGemmParams& p) {
  MOE_XLA_RETURN_IF_ERROR(detail::validate_gather("gather_gemm", "x and w", p.in_dtype, p.out_dtype,
                                                  {p.tokens, p.m, p.k, p.n, p.num_groups},
                                                  p.transpose_w ? "x and w" : "x",
                                                  p.transpose_w ? "out" : "w and out"));
  return p.activated ? validate_activation(p) : Status();
}

}  // namespace

size_t gather_gemm_workspace_bytes(int64_t m, int64_t num_groups) {
  if (m < 0 || m > kGatherMaxDim || num_groups < 0 || num_groups > kGatherMaxDim) return 0;
  return kAlign /* slack to align the base */ + WorkspaceLayout(m, num_groups).total;
}

size_t gather_gemm_workspace_bytes(const GatherGemmParams& p) {
  if (!validate(p).ok()) return 0;
  return gather_gemm_workspace_bytes(p.m, p.num_groups);
}

Status gather_gemm(const GatherGemmParams& p, void* workspace, size_t workspace_bytes,
                   cudaStream_t stream) {
  MOE_XLA_RETURN_IF_ERROR(validate(p));
  if (p.m == 0 || p.n == 0) return Status();  // nothing to write
  if (p.out == nullptr) return Status::InvalidArgument("gather_gemm: null output pointer");
  if (!aligned16(p.out)) return Status::InvalidArgument("gather_gemm: out is not 16-byte aligned");
  // Every row is zero when no group has a row, the dot products are empty or every src is
  // out of range.
  if (p.num_groups == 0 || p.k == 0 || p.tokens == 0) {
    MOE_XLA_RETURN_IF_CUDA_ERROR(
        cudaMemsetAsync(p.out, 0, static_cast<size_t>(p.m * out_cols(p)) * dtype_bytes(p.out_dtype), stream));
    return Status();
  }
  if (p.x == nullptr || p.w == nullptr || p.src == nullptr || p.group_sizes == nullptr) {
    return Status::InvalidArgument("gather_gemm: null x, w, src or group_sizes pointer");
  }
  if (!aligned16(p.x) || !aligned16(p.w)) {
    return Status::InvalidArgument("gather_gemm: x and w must be 16-byte aligned");
  }
  MOE_XLA_RETURN_IF_ERROR(require_device(DeviceSupport::kFull, "gather_gemm"));
  int sm_count = 0;
  MOE_XLA_RETURN_IF_ERROR(current_device_sm_count(&sm_count));
  const size_t needed = gather_gemm_workspace_bytes(p);
  MOE_XLA_RETURN_IF_ERROR(
      detail::check_workspace("gather_gemm", workspace, workspace_bytes, needed));

  char* base = detail::aligned_base(workspace);
  const WorkspaceLayout layout(p.m, p.num_groups);
  auto* groups = reinterpret_cast<GroupTiles*>(base + layout.groups);
  auto* count = reinterpret_cast<GatherTileCount*>(base + layout.count);
  auto* row_tiles = reinterpret_cast<GatherRowTile*>(base + layout.row_tiles);

  gather_group_tiles_kernel<<<1, kScanThreads, 0, stream>>>(p.group_sizes, p.num_groups, p.m,
                                                           groups, count);
  MOE_XLA_RETURN_IF_CUDA_ERROR(cudaGetLastError());  // launch of the group scan
  const int64_t row_vecs = out_cols(p) * static_cast<int64_t>(dtype_bytes(p.out_dtype)) / 16;
  const int64_t work = std::max(max_row_tiles(p), p.m * row_vecs);
  const int64_t blocks =
      std::clamp<int64_t>((work + kFillThreads - 1) / kFillThreads, 1, 2 * int64_t{sm_count});
  gather_row_tiles_kernel<<<static_cast<unsigned>(blocks), kFillThreads, 0, stream>>>(
      groups, p.num_groups, count, row_tiles, static_cast<uint4*>(p.out), p.m, row_vecs);
  MOE_XLA_RETURN_IF_CUDA_ERROR(cudaGetLastError());  // launch of the row-tile table

  const detail::GatherGemmLaunch launch{&p, row_tiles, count, max_row_tiles(p), sm_count, stream};
  return find_instance(p)->run(launch).With("gather_gemm");
}

}  // namespace cuda
}  // namespace moe_xla
