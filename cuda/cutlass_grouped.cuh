// CUTLASS 4 sm90 ptr-array grouped GEMM, templated on (dtype, layout, tile config); the
// tile scheduler's raster order comes at run time (CutlassGroupedArgs).
//
// Only cutlass_instance.cu includes this header; it is compiled once per entry of the
// instance table in cuda/BUILD.bazel, each compilation instantiating one combination, so
// that these long compiles run in parallel and are cached one by one.
//
// Mapping of the three grouped products onto CUTLASS's D[M,N] = A[M,K] B[K,N] (per group g,
// rows r_g = offsets[g] .. offsets[g+1], m_g = rows in the group):
//   kGmm:           M = m_g, N = N, K = K. A = lhs + r_g*K   (row-major, K-major, ld K)
//                   B = rhs + g*K*N (stored [K,N]: N-major, ld N), D = out + r_g*N (ld N)
//   kGmmTransposed: as kGmm but B = rhs + g*N*K stored [N,K] (K-major, ld K)
//   kTgmm:          M = K, N = N, K = m_g. A = lhs + r_g*K read as lhs_block^T
//                   (column-major, M-major, ld K), B = rhs + r_g*N ([m_g,N], N-major, ld N),
//                   D = out + g*K*N (ld N)
// Empty groups get M = 0 so they yield zero tiles. What CUTLASS leaves unwritten is zeroed
// by the prep kernel (gmm rows past the last group) or the dispatcher (tgmm blocks of empty
// groups).
// Problem shapes live only on the device (host problem shapes = nullptr): the persistent
// group tile scheduler (CUTLASS's, in the team order of team_scheduler.cuh) reads them,
// and TMA descriptors are rewritten on the device per group.
#ifndef MOE_XLA_CUDA_CUTLASS_GROUPED_CUH_
#define MOE_XLA_CUDA_CUTLASS_GROUPED_CUH_

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/operations.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/gemm/kernel/tile_scheduler_detail.hpp"
#include "cutlass/kernel_hardware_info.hpp"
#include "cutlass/numeric_types.h"

#include "common/grouped_gemm.h"
#include "common/status.h"
#include "cuda/group_offsets.cuh"
#include "cuda/grouped_gemm_internal.h"
#include "cuda/team_scheduler.cuh"

#if !defined(CUTLASS_ARCH_MMA_SM90_SUPPORTED) || \
    !defined(CUTLASS_ARCH_MMA_MODIFIABLE_TMA_SM90_SUPPORTED)
#error "moe_xla: the CUTLASS grouped GEMM needs CUDA >= 12.3 (sm90 with modifiable TMA descriptors)"
#endif

namespace moe_xla {
namespace cuda {
namespace detail {

template <DType kDType>
struct CutlassElement;
template <>
struct CutlassElement<DType::kBF16> {
  using type = cutlass::bfloat16_t;
};
template <>
struct CutlassElement<DType::kF16> {
  using type = cutlass::half_t;
};

// CUTLASS layout tags of A and B (D is always row-major), see the header comment.
template <GroupedLayout kLayout>
struct CutlassLayouts;
template <>
struct CutlassLayouts<GroupedLayout::kGmm> {
  using A = cutlass::layout::RowMajor;
  using B = cutlass::layout::RowMajor;
};
template <>
struct CutlassLayouts<GroupedLayout::kGmmTransposed> {
  using A = cutlass::layout::RowMajor;
  using B = cutlass::layout::ColumnMajor;
};
template <>
struct CutlassLayouts<GroupedLayout::kTgmm> {
  using A = cutlass::layout::ColumnMajor;
  using B = cutlass::layout::RowMajor;
};

// Kernel schedule, CTA tile and cluster of one configuration. Cooperative: both consumer
// warp groups share one tile (split along M). Pingpong: each consumer warp group owns a
// tile and their mainloops and epilogues alternate, which hides the epilogue.
// A cluster of cm x cn CTAs multicasts B tiles across its cm CTAs (same N, consecutive M)
// and A tiles across its cn CTAs; the scheduler rounds every group's tile count up to
// whole clusters, so cm > 1 pads each group's rows to cm * tile M.
template <int kTileM, int kTileN, int kTileK, int kClusterM, int kClusterN, bool kPingpong>
struct CutlassTileTraits {
  using TileShape = cute::Shape<cute::Int<kTileM>, cute::Int<kTileN>, cute::Int<kTileK>>;
  using ClusterShape = cute::Shape<cute::Int<kClusterM>, cute::Int<kClusterN>, cute::_1>;
  using KernelSchedule =
      std::conditional_t<kPingpong, cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong,
                         cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative>;
  using EpilogueSchedule =
      std::conditional_t<kPingpong, cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong,
                         cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative>;
};

template <TileConfig kTile>
struct CutlassTile;
// Few rows per group (decode, many experts) or narrow N: 64-row tiles so that small groups
// waste little, no cluster (a 2x1 cluster would round every group up to 128 rows).
template <>
struct CutlassTile<TileConfig::kSmall> : CutlassTileTraits<64, 128, 128, 1, 1, true> {};
// Many rows per group (training, prefill): large cooperative tiles, B tiles multicast to
// the two CTAs of a 2x1 cluster (groups padded to 256 rows).
template <>
struct CutlassTile<TileConfig::kLarge> : CutlassTileTraits<128, 256, 64, 2, 1, false> {};
// The large tile without a cluster: groups padded to 128 rows only, no multicast.
template <>
struct CutlassTile<TileConfig::kCoop128x256Cluster1x1>
    : CutlassTileTraits<128, 256, 64, 1, 1, false> {};
// The large tile with A tiles multicast along N: groups padded to 128 rows (N must fill
// pairs of 256-column tiles to avoid padding in N).
template <>
struct CutlassTile<TileConfig::kCoop128x256Cluster1x2>
    : CutlassTileTraits<128, 256, 64, 1, 2, false> {};
// Pingpong (epilogue hidden behind the other warp group's mainloop) with B multicast over
// a 2x1 cluster of 64-row tiles: groups padded to 128 rows.
template <>
struct CutlassTile<TileConfig::kPingpong64x256Cluster2x1>
    : CutlassTileTraits<64, 256, 64, 2, 1, true> {};

template <DType kDType, GroupedLayout kLayout, TileConfig kTile>
struct CutlassGroupedGemm {
  using Element = typename CutlassElement<kDType>::type;
  using ElementAccumulator = float;
  using LayoutA = typename CutlassLayouts<kLayout>::A;
  using LayoutB = typename CutlassLayouts<kLayout>::B;
  using LayoutD = cutlass::layout::RowMajor;
  static constexpr int kAlignment = 128 / cutlass::sizeof_bits<Element>::value;  // 16 bytes

  using Tile = CutlassTile<kTile>;
  using ProblemShape = TeamGroupShape;  // selects the team tile scheduler

  // Sourceless epilogue (ElementC = void): D = 1 * accumulator, converted to Element.
  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, typename Tile::TileShape,
      typename Tile::ClusterShape, cutlass::epilogue::collective::EpilogueTileAuto,
      ElementAccumulator, ElementAccumulator, void, LayoutD*, kAlignment, Element, LayoutD*,
      kAlignment, typename Tile::EpilogueSchedule,
      cutlass::epilogue::fusion::LinearCombination<Element, ElementAccumulator>>::CollectiveOp;

  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, LayoutA*, kAlignment,
      Element, LayoutB*, kAlignment, ElementAccumulator, typename Tile::TileShape,
      typename Tile::ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      typename Tile::KernelSchedule>::CollectiveOp;

  using GemmKernel =
      cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop, CollectiveEpilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;
  using Arguments = typename Gemm::Arguments;

  using UnderlyingShape = typename ProblemShape::UnderlyingProblemShape;
  using StrideA = typename GemmKernel::InternalStrideA;
  using StrideB = typename GemmKernel::InternalStrideB;
  using StrideC = typename GemmKernel::InternalStrideC;
  using StrideD = typename GemmKernel::InternalStrideD;

  // Per-group metadata arrays at the start of the workspace; CUTLASS's own workspace
  // (TMA descriptors per SM) follows.
  struct MetaLayout {
    size_t shapes, ptr_a, ptr_b, ptr_d, stride_a, stride_b, stride_d, cutlass, total_meta;
    explicit MetaLayout(int64_t groups) {
      const size_t g = static_cast<size_t>(groups);
      size_t at = 0;
      auto take = [&](size_t bytes) {
        const size_t here = at;
        at = align_up(at + bytes, kWorkspaceAlign);
        return here;
      };
      shapes = take(g * sizeof(UnderlyingShape));
      ptr_a = take(g * sizeof(void*));
      ptr_b = take(g * sizeof(void*));
      ptr_d = take(g * sizeof(void*));
      stride_a = take(g * sizeof(StrideA));
      stride_b = take(g * sizeof(StrideB));
      stride_d = take(g * sizeof(StrideD));
      cutlass = at;
      total_meta = at;
    }
  };
};

// A stride whose one dynamic mode (of the first two) is the leading dimension `ld`; the
// others are static (_1 for the contiguous mode, _0 for the group mode).
template <class Stride>
__device__ __forceinline__ Stride make_leading_stride(int64_t ld) {
  static_assert(cute::is_static<decltype(cute::get<2>(Stride{}))>::value,
                "grouped GEMM strides must have a static (zero) batch mode");
  Stride s{};
  if constexpr (!cute::is_static<decltype(cute::get<0>(s))>::value) {
    cute::get<0>(s) = ld;
  }
  if constexpr (!cute::is_static<decltype(cute::get<1>(s))>::value) {
    cute::get<1>(s) = ld;
  }
  return s;
}

// The one kernel before the GEMM. Block 0 scans the group sizes into offsets (kept in the
// workspace for the dispatcher's tgmm zeroing) and writes every group's CUTLASS problem
// shape, operand pointers and strides. For gmm every block runs the scan to learn the
// covered rows, and the grid zeroes the output rows past them, which no tile of the GEMM
// writes. Launched with kScanThreads threads per block.
template <class Config, GroupedLayout kLayout>
__global__ void __launch_bounds__(kScanThreads) cutlass_grouped_prep_kernel(
    const int32_t* __restrict__ group_sizes, int64_t num_groups, int64_t m, int64_t k,
    int64_t n, const typename Config::Element* lhs, const typename Config::Element* rhs,
    typename Config::Element* out, int64_t* __restrict__ offsets,
    typename Config::UnderlyingShape* shapes, const typename Config::Element** ptr_a,
    const typename Config::Element** ptr_b, typename Config::Element** ptr_d,
    typename Config::StrideA* stride_a, typename Config::StrideB* stride_b,
    typename Config::StrideD* stride_d) {
  const bool writer = blockIdx.x == 0;
  const int ik = static_cast<int>(k), in = static_cast<int>(n);
  auto fill = [&](int64_t g, int64_t start, int64_t end) {
    if (!writer) return;
    const int64_t rows = end - start;
    if constexpr (kLayout == GroupedLayout::kTgmm) {
      shapes[g] = rows > 0 ? cute::make_shape(ik, in, static_cast<int>(rows))
                           : cute::make_shape(0, in, 0);
      ptr_a[g] = lhs + start * k;
      ptr_b[g] = rhs + start * n;
      ptr_d[g] = out + g * k * n;
      stride_a[g] = make_leading_stride<typename Config::StrideA>(k);
      stride_b[g] = make_leading_stride<typename Config::StrideB>(n);
      stride_d[g] = make_leading_stride<typename Config::StrideD>(n);
    } else {
      shapes[g] = cute::make_shape(static_cast<int>(rows), in, ik);
      ptr_a[g] = lhs + start * k;
      ptr_b[g] = rhs + g * k * n;
      ptr_d[g] = out + start * n;
      stride_a[g] = make_leading_stride<typename Config::StrideA>(k);
      stride_b[g] = make_leading_stride<typename Config::StrideB>(
          kLayout == GroupedLayout::kGmm ? n : k);
      stride_d[g] = make_leading_stride<typename Config::StrideD>(n);
    }
  };
  const int64_t covered =
      scan_group_offsets(group_sizes, num_groups, m, writer ? offsets : nullptr, fill);
  if constexpr (kLayout != GroupedLayout::kTgmm) {
    zero_rows_from(reinterpret_cast<uint4*>(out), covered, m, n / 8);
  }
}

// Blocks of the prep kernel: one for tgmm; for gmm enough to zero uncovered rows at full
// bandwidth (at most two per SM), fewer when G is large, since each block reads all of
// group_sizes.
inline int64_t prep_blocks(const GroupedGemmParams& p, int sm_count) {
  if (p.layout == GroupedLayout::kTgmm) return 1;
  const int64_t vec_blocks = (p.m * (p.n / 8) + kScanThreads - 1) / kScanThreads;
  const int64_t read_budget =
      std::max<int64_t>((int64_t{1} << 22) / std::max<int64_t>(p.num_groups, 1), 1);
  return std::max<int64_t>(std::min({vec_blocks, 2 * int64_t{sm_count}, read_budget}), 1);
}

template <class Config>
typename Config::Arguments make_cutlass_arguments(
    int64_t num_groups, int sm_count, RasterOrder raster, int team_clusters, int team_waves,
    typename Config::UnderlyingShape* shapes,
    const typename Config::Element** ptr_a, const typename Config::Element** ptr_b,
    typename Config::Element** ptr_d, typename Config::StrideA* stride_a,
    typename Config::StrideB* stride_b, typename Config::StrideD* stride_d) {
  typename Config::Arguments args{};
  args.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
  args.problem_shape = {{static_cast<int>(num_groups), shapes, /*host_problem_shapes=*/nullptr},
                        team_clusters, team_waves};
  args.mainloop.ptr_A = ptr_a;
  args.mainloop.dA = stride_a;
  args.mainloop.ptr_B = ptr_b;
  args.mainloop.dB = stride_b;
  args.epilogue.thread.alpha = 1.0f;
  args.epilogue.thread.beta = 0.0f;
  args.epilogue.ptr_C = nullptr;
  if constexpr (std::is_same_v<typename Config::StrideC, typename Config::StrideD>) {
    args.epilogue.dC = stride_d;  // unused (no source), but a valid array as CUTLASS expects
  }
  args.epilogue.ptr_D = ptr_d;
  args.epilogue.dD = stride_d;
  args.hw_info.device_id = 0;  // only used when sm_count <= 0, which we never pass
  args.hw_info.sm_count = sm_count;
  // Persistent group tile scheduler (runtime options; its workspace does not depend on them).
  using RasterOptions = cutlass::gemm::kernel::detail::RasterOrderOptions;
  args.scheduler.raster_order =
      raster == RasterOrder::kAlongN ? RasterOptions::AlongN : RasterOptions::AlongM;
  return args;
}

template <DType kDType, GroupedLayout kLayout, TileConfig kTile>
size_t cutlass_grouped_workspace_bytes(int64_t num_groups, int sm_count) {
  using Config = CutlassGroupedGemm<kDType, kLayout, kTile>;
  typename Config::MetaLayout layout(num_groups);
  auto args = make_cutlass_arguments<Config>(num_groups, sm_count, RasterOrder::kAlongM, 1, 1,
                                             nullptr, nullptr, nullptr, nullptr, nullptr,
                                             nullptr, nullptr);
  return layout.total_meta + align_up(Config::Gemm::get_workspace_size(args), kWorkspaceAlign);
}

// A CUTLASS call's result as a Status that names the call.
inline Status cutlass_call_status(cutlass::Status status, const char* call) {
  if (status == cutlass::Status::kSuccess) return Status();
  return Status::Internal(std::string("CUTLASS ") + call + " failed: " +
                          cutlass::cutlassGetStatusString(status));
}

template <DType kDType, GroupedLayout kLayout, TileConfig kTile>
Status cutlass_grouped_run(const CutlassGroupedArgs& a) {
  using Config = CutlassGroupedGemm<kDType, kLayout, kTile>;
  using Element = typename Config::Element;
  const GroupedGemmParams& p = *a.params;
  if (p.num_groups <= 0 || p.num_groups > INT32_MAX) {
    return Status::InvalidArgument("CUTLASS grouped GEMM: number of groups " +
                                   std::to_string(p.num_groups) + " is outside [1, 2^31)");
  }
  const typename Config::MetaLayout layout(p.num_groups);
  char* base = static_cast<char*>(a.workspace);
  if (a.workspace_bytes < layout.total_meta) {
    return Status::InvalidArgument("CUTLASS grouped GEMM: workspace of " +
                                   std::to_string(a.workspace_bytes) + " bytes, the group metadata needs " +
                                   std::to_string(layout.total_meta));
  }
  auto* shapes = reinterpret_cast<typename Config::UnderlyingShape*>(base + layout.shapes);
  auto* ptr_a = reinterpret_cast<const Element**>(base + layout.ptr_a);
  auto* ptr_b = reinterpret_cast<const Element**>(base + layout.ptr_b);
  auto* ptr_d = reinterpret_cast<Element**>(base + layout.ptr_d);
  auto* stride_a = reinterpret_cast<typename Config::StrideA*>(base + layout.stride_a);
  auto* stride_b = reinterpret_cast<typename Config::StrideB*>(base + layout.stride_b);
  auto* stride_d = reinterpret_cast<typename Config::StrideD*>(base + layout.stride_d);

  cutlass_grouped_prep_kernel<Config, kLayout>
      <<<static_cast<unsigned>(prep_blocks(p, a.sm_count)), kScanThreads, 0, a.stream>>>(
      p.group_sizes, p.num_groups, p.m, p.k, p.n, static_cast<const Element*>(p.lhs),
      static_cast<const Element*>(p.rhs), static_cast<Element*>(p.out), a.offsets, shapes, ptr_a,
      ptr_b, ptr_d, stride_a, stride_b, stride_d);
  MOE_XLA_RETURN_IF_CUDA_ERROR(cudaGetLastError());  // launch of the prep kernel

  auto args = make_cutlass_arguments<Config>(p.num_groups, a.sm_count, a.raster,
                                             a.team_clusters, a.team_waves, shapes, ptr_a, ptr_b,
                                             ptr_d, stride_a, stride_b, stride_d);
  typename Config::Gemm gemm;
  MOE_XLA_RETURN_IF_ERROR(cutlass_call_status(gemm.can_implement(args), "can_implement"));
  const size_t cutlass_bytes = Config::Gemm::get_workspace_size(args);
  if (a.workspace_bytes - layout.total_meta < cutlass_bytes) {
    return Status::InvalidArgument("CUTLASS grouped GEMM: workspace of " +
                                   std::to_string(a.workspace_bytes) + " bytes, metadata and " +
                                   "CUTLASS workspace need " +
                                   std::to_string(layout.total_meta + cutlass_bytes));
  }
  void* cutlass_workspace = base + layout.cutlass;
  // initialize writes CUTLASS's workspace and sets the kernel's shared memory size.
  MOE_XLA_RETURN_IF_ERROR(cutlass_call_status(gemm.initialize(args, cutlass_workspace, a.stream),
                                              "initialize"));
  // run launches the GEMM; CUTLASS reads and clears the launch's CUDA error itself and
  // reports it as kErrorInternal.
  MOE_XLA_RETURN_IF_ERROR(cutlass_call_status(gemm.run(a.stream), "run"));
  MOE_XLA_RETURN_IF_CUDA_ERROR(cudaGetLastError());
  return Status();
}

}  // namespace detail
}  // namespace cuda
}  // namespace moe_xla

#endif  // MOE_XLA_CUDA_CUTLASS_GROUPED_CUH_
