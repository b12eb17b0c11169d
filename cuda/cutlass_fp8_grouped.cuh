// CUTLASS 4 sm90 FP8 blockwise-scaled ptr-array grouped GEMM, templated on (output dtype,
// tile config); the contract is common/fp8_grouped_gemm.h.
//
// Only cutlass_fp8_instance.cu (and, for the wgrad's scaling, cutlass_fp8_wgrad.cuh)
// includes this header, once per entry of an FP8 instance table in cuda/BUILD.bazel.
// Forward and dgrad: per group g (rows r_g = start_g .. end_g, m_g rows), CUTLASS's
// D[M,N] = A[M,K] B[K,N] with both operands K-major:
//   M = m_g, N = N, K = K.  A = lhs + r_g*K ([m_g, K] row-major, ld K);
//   B = rhs + g*N*K (stored [N, K]: column-major [K, N], ld K); D = out + r_g*N (ld N).
//   SFA = lhs_scales + r_g*Kt: [m_g, Kt], K-major (one scale per row per 128 columns);
//   SFB = rhs_scales + g*Kt*Nt: [Kt, Nt], N-major (one scale per 128 x 128 block).
// CUTLASS's mainloop rebuilds each group's scale layouts from its problem shape (packed:
// SFA row stride Kt, SFB k-block stride Nt), which is what those two slices are. It loads
// the scales with predicated cp.async (partial M and N tiles read no scale past the
// group), TMA zero-fills the K tail of the last 128-deep step, and after every step it
// adds fl(s_a * s_b) * (the step's tensor-core partial sum) to the float32 accumulator.
// Empty groups get M = 0 and yield no tile; the prep kernel zeroes rows past the groups.
#ifndef MOE_XLA_CUDA_CUTLASS_FP8_GROUPED_CUH_
#define MOE_XLA_CUDA_CUTLASS_FP8_GROUPED_CUH_

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>

#include "cutlass/detail/blockwise_scale_layout.hpp"
#include "cuda/cutlass_grouped.cuh"  // make_leading_stride, cutlass_call_status, TeamGroupShape
#include "cuda/fp8_grouped_gemm_internal.h"

namespace moe_xla {
namespace cuda {
namespace detail {

template <DType kOut>
struct Fp8OutElement;
template <>
struct Fp8OutElement<DType::kBF16> {
  using type = cutlass::bfloat16_t;
};
template <>
struct Fp8OutElement<DType::kF32> {
  using type = float;
};

// Cooperative: both consumer warp groups share one tile (split along M). Pingpong: each
// consumer warp group owns a tile; their mainloops and epilogues alternate. The blockwise
// mainloop keeps two float32 accumulator sets per thread (the running sum and the current
// step's partial sum), so a consumer warp group's share of a tile stays at 64 x 128.
template <int kTileM, int kTileN, int kClusterM, int kClusterN, bool kPingpong>
struct CutlassFp8TileTraits {
  using TileShape = cute::Shape<cute::Int<kTileM>, cute::Int<kTileN>, cute::_128>;
  using ClusterShape = cute::Shape<cute::Int<kClusterM>, cute::Int<kClusterN>, cute::_1>;
  using KernelSchedule =
      std::conditional_t<kPingpong, cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpongFP8Blockwise,
                         cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8Blockwise>;
  using EpilogueSchedule =
      std::conditional_t<kPingpong, cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong,
                         cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative>;
};

template <Fp8TileConfig kTile>
struct CutlassFp8Tile;
// Many rows per group: 128-row tiles, A tiles multicast to the two CTAs of a 1x2 cluster
// (pairs of 128-column tiles).
template <>
struct CutlassFp8Tile<Fp8TileConfig::kCoop128x128Cluster1x2> : CutlassFp8TileTraits<128, 128, 1, 2, false> {};
// Many rows per group, B tiles multicast to the two CTAs of a 2x1 cluster (groups padded
// to 256 rows).
template <>
struct CutlassFp8Tile<Fp8TileConfig::kCoop128x128Cluster2x1> : CutlassFp8TileTraits<128, 128, 2, 1, false> {};
// Few rows per group: 64-row tiles waste little on small groups.
template <>
struct CutlassFp8Tile<Fp8TileConfig::kPingpong64x128Cluster1x1> : CutlassFp8TileTraits<64, 128, 1, 1, true> {};

template <Fp8Scaling kScaling>
struct CutlassFp8ScaleConfig;
// Scale granularity 1 x 128 (A) and 128 x 128 (B) over (M or N, K); A's scales K-major,
// B's N-major (see the header comment).
template <>
struct CutlassFp8ScaleConfig<Fp8Scaling::kRowTilesBlocks> {
  using type = cutlass::detail::Sm90BlockwiseScaleConfig<1, 128, 128, cute::GMMA::Major::K, cute::GMMA::Major::MN>;
};
// Granularity 1 x 1 x 128: one scale per row of A and per column of B per 128-deep step,
// both MN-major (cutlass_fp8_wgrad.cuh).
template <>
struct CutlassFp8ScaleConfig<Fp8Scaling::kColTiles> {
  using type = cutlass::detail::Sm90BlockwiseScaleConfig<1, 1, 128, cute::GMMA::Major::MN, cute::GMMA::Major::MN>;
};

template <DType kOut, Fp8TileConfig kTile, Fp8Scaling kScaling = Fp8Scaling::kRowTilesBlocks>
struct CutlassFp8GroupedGemm {
  using ElementAB = cutlass::float_e4m3_t;
  using ElementD = typename Fp8OutElement<kOut>::type;
  using ElementAccumulator = float;
  using LayoutA = cutlass::layout::RowMajor;     // [M, K], K contiguous
  using LayoutB = cutlass::layout::ColumnMajor;  // [K, N] stored as [N, K], K contiguous
  using LayoutD = cutlass::layout::RowMajor;
  static constexpr int kAlignmentAB = 16;                                            // 16 bytes
  static constexpr int kAlignmentD = 128 / cutlass::sizeof_bits<ElementD>::value;    // 16 bytes

  using ScaleConfig = typename CutlassFp8ScaleConfig<kScaling>::type;
  using LayoutSFA = decltype(ScaleConfig::deduce_layoutSFA());
  using LayoutSFB = decltype(ScaleConfig::deduce_layoutSFB());

  using Tile = CutlassFp8Tile<kTile>;
  using ProblemShape = TeamGroupShape;

  // Sourceless epilogue (ElementC = void): D = accumulator converted to ElementD.
  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, typename Tile::TileShape,
      typename Tile::ClusterShape, cutlass::epilogue::collective::EpilogueTileAuto,
      ElementAccumulator, ElementAccumulator, void, LayoutD*, kAlignmentD, ElementD, LayoutD*,
      kAlignmentD, typename Tile::EpilogueSchedule,
      cutlass::epilogue::fusion::LinearCombination<ElementD, ElementAccumulator>>::CollectiveOp;

  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementAB,
      cute::tuple<LayoutA*, LayoutSFA*>, kAlignmentAB, ElementAB, cute::tuple<LayoutB*, LayoutSFB*>,
      kAlignmentAB, ElementAccumulator, typename Tile::TileShape, typename Tile::ClusterShape,
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
    size_t shapes, ptr_a, ptr_b, ptr_d, ptr_sfa, ptr_sfb, stride_a, stride_b, stride_d, layout_sfa,
        layout_sfb, cutlass;
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
      ptr_sfa = take(g * sizeof(void*));
      ptr_sfb = take(g * sizeof(void*));
      stride_a = take(g * sizeof(StrideA));
      stride_b = take(g * sizeof(StrideB));
      stride_d = take(g * sizeof(StrideD));
      layout_sfa = take(g * sizeof(LayoutSFA));
      layout_sfb = take(g * sizeof(LayoutSFB));
      cutlass = at;
    }
  };

  // Typed views of the metadata arrays in a workspace.
  // Value-initialised (all null) it serves to size the workspace.
  struct Meta {
    UnderlyingShape* shapes = nullptr;
    const ElementAB** ptr_a = nullptr;
    const ElementAB** ptr_b = nullptr;
    ElementD** ptr_d = nullptr;
    const float** ptr_sfa = nullptr;
    const float** ptr_sfb = nullptr;
    StrideA* stride_a = nullptr;
    StrideB* stride_b = nullptr;
    StrideD* stride_d = nullptr;
    LayoutSFA* layout_sfa = nullptr;
    LayoutSFB* layout_sfb = nullptr;

    Meta() = default;
    Meta(char* base, const MetaLayout& l)
        : shapes(reinterpret_cast<UnderlyingShape*>(base + l.shapes)),
          ptr_a(reinterpret_cast<const ElementAB**>(base + l.ptr_a)),
          ptr_b(reinterpret_cast<const ElementAB**>(base + l.ptr_b)),
          ptr_d(reinterpret_cast<ElementD**>(base + l.ptr_d)),
          ptr_sfa(reinterpret_cast<const float**>(base + l.ptr_sfa)),
          ptr_sfb(reinterpret_cast<const float**>(base + l.ptr_sfb)),
          stride_a(reinterpret_cast<StrideA*>(base + l.stride_a)),
          stride_b(reinterpret_cast<StrideB*>(base + l.stride_b)),
          stride_d(reinterpret_cast<StrideD*>(base + l.stride_d)),
          layout_sfa(reinterpret_cast<LayoutSFA*>(base + l.layout_sfa)),
          layout_sfb(reinterpret_cast<LayoutSFB*>(base + l.layout_sfb)) {}
  };
};

// The one kernel before the GEMM (kScanThreads threads per block). Block 0 scans the group
// sizes and writes every group's problem shape, pointers, strides and scale layouts;
// every block runs the scan to learn the covered rows, and the grid zeroes the output rows
// past them, which no tile writes.
template <class Config>
__global__ void __launch_bounds__(kScanThreads)
    cutlass_fp8_prep_kernel(Fp8GroupedGemmParams p, typename Config::Meta meta) {
  const bool writer = blockIdx.x == 0;
  const int64_t kt = fp8::tiles(p.k), nt = fp8::tiles(p.n);
  const int ik = static_cast<int>(p.k), in = static_cast<int>(p.n);
  auto fill = [&](int64_t g, int64_t start, int64_t end) {
    if (!writer) return;
    const int rows = static_cast<int>(end - start);
    meta.shapes[g] = cute::make_shape(rows, in, ik);
    meta.ptr_a[g] = reinterpret_cast<const typename Config::ElementAB*>(p.lhs + start * p.k);
    meta.ptr_b[g] = reinterpret_cast<const typename Config::ElementAB*>(p.rhs + g * p.n * p.k);
    meta.ptr_d[g] = static_cast<typename Config::ElementD*>(p.out) + start * p.n;
    meta.ptr_sfa[g] = p.lhs_scales + start * kt;
    meta.ptr_sfb[g] = p.rhs_scales + g * kt * nt;
    meta.stride_a[g] = make_leading_stride<typename Config::StrideA>(p.k);
    meta.stride_b[g] = make_leading_stride<typename Config::StrideB>(p.k);
    meta.stride_d[g] = make_leading_stride<typename Config::StrideD>(p.n);
    meta.layout_sfa[g] = Config::ScaleConfig::tile_atom_to_shape_SFA(cute::make_shape(rows, in, ik, 1));
    meta.layout_sfb[g] = Config::ScaleConfig::tile_atom_to_shape_SFB(cute::make_shape(rows, in, ik, 1));
  };
  const int64_t covered = scan_group_offsets(p.group_sizes, p.num_groups, p.m, nullptr, fill);
  zero_rows_from(static_cast<uint4*>(p.out), covered, p.m,
                 p.n * static_cast<int64_t>(sizeof(typename Config::ElementD)) / 16);
}

template <class Config>
typename Config::Arguments make_fp8_arguments(int64_t num_groups, int sm_count, RasterOrder raster,
                                              int team_clusters, int team_waves, const typename Config::Meta& meta) {
  typename Config::Arguments args{};
  args.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
  // The tile order of team_scheduler.cuh (INT32_MAX clusters per team: CUTLASS's own).
  args.problem_shape = {{static_cast<int>(num_groups), meta.shapes, /*host_problem_shapes=*/nullptr},
                        team_clusters, team_waves};
  args.mainloop.ptr_A = meta.ptr_a;
  args.mainloop.dA = meta.stride_a;
  args.mainloop.ptr_B = meta.ptr_b;
  args.mainloop.dB = meta.stride_b;
  args.mainloop.ptr_SFA = meta.ptr_sfa;
  args.mainloop.layout_SFA = meta.layout_sfa;
  args.mainloop.ptr_SFB = meta.ptr_sfb;
  args.mainloop.layout_SFB = meta.layout_sfb;
  args.epilogue.thread.alpha = 1.0f;
  args.epilogue.thread.beta = 0.0f;
  args.epilogue.ptr_C = nullptr;
  if constexpr (std::is_same_v<typename Config::StrideC, typename Config::StrideD>) {
    args.epilogue.dC = meta.stride_d;  // unused (no source), but a valid array as CUTLASS expects
  }
  args.epilogue.ptr_D = meta.ptr_d;
  args.epilogue.dD = meta.stride_d;
  args.hw_info.device_id = 0;  // only used when sm_count <= 0, which we never pass
  args.hw_info.sm_count = sm_count;
  using RasterOptions = cutlass::gemm::kernel::detail::RasterOrderOptions;
  args.scheduler.raster_order = raster == RasterOrder::kAlongN ? RasterOptions::AlongN : RasterOptions::AlongM;
  return args;
}

// Workspace bytes of Config's GEMM for `num_groups` groups: metadata arrays, then
// CUTLASS's own (for the forward and the wgrad alike).
template <class Config>
size_t fp8_config_workspace_bytes(int64_t num_groups, int sm_count) {
  const typename Config::MetaLayout layout(num_groups);
  const typename Config::Meta meta{};
  auto args = make_fp8_arguments<Config>(num_groups, sm_count, RasterOrder::kAlongM, INT32_MAX, 1, meta);
  return layout.cutlass + align_up(Config::Gemm::get_workspace_size(args), kWorkspaceAlign);
}

// Checks that the workspace holds Config's metadata for `num_groups` groups (`what`
// names the GEMM in errors).
template <class Config>
Status check_fp8_metadata(int64_t num_groups, size_t workspace_bytes, const char* what) {
  if (num_groups <= 0 || num_groups > INT32_MAX) {
    return Status::InvalidArgument(std::string(what) + ": number of groups " + std::to_string(num_groups) +
                                   " is outside [1, 2^31)");
  }
  const typename Config::MetaLayout layout(num_groups);
  if (workspace_bytes < layout.cutlass) {
    return Status::InvalidArgument(std::string(what) + ": workspace of " + std::to_string(workspace_bytes) +
                                   " bytes, the group metadata needs " + std::to_string(layout.cutlass));
  }
  return Status();
}

// Enqueues Config's GEMM on the metadata that a prep kernel, enqueued before on the same
// stream, writes into the workspace.
template <class Config>
Status run_fp8_gemm(const typename Config::Arguments& args, char* base, size_t workspace_bytes, int64_t num_groups,
                    cudaStream_t stream, const char* what) {
  const typename Config::MetaLayout layout(num_groups);
  typename Config::Gemm gemm;
  MOE_XLA_RETURN_IF_ERROR(cutlass_call_status(gemm.can_implement(args), "can_implement"));
  const size_t cutlass_bytes = Config::Gemm::get_workspace_size(args);
  if (workspace_bytes - layout.cutlass < cutlass_bytes) {
    return Status::InvalidArgument(std::string(what) + ": workspace of " + std::to_string(workspace_bytes) +
                                   " bytes, metadata and CUTLASS workspace need " +
                                   std::to_string(layout.cutlass + cutlass_bytes));
  }
  MOE_XLA_RETURN_IF_ERROR(cutlass_call_status(gemm.initialize(args, base + layout.cutlass, stream), "initialize"));
  MOE_XLA_RETURN_IF_ERROR(cutlass_call_status(gemm.run(stream), "run"));
  MOE_XLA_RETURN_IF_CUDA_ERROR(cudaGetLastError());
  return Status();
}

template <DType kOut, Fp8TileConfig kTile>
size_t cutlass_fp8_workspace_bytes(int64_t num_groups, int sm_count) {
  return fp8_config_workspace_bytes<CutlassFp8GroupedGemm<kOut, kTile>>(num_groups, sm_count);
}

template <DType kOut, Fp8TileConfig kTile>
Status cutlass_fp8_run(const CutlassFp8Args& a) {
  using Config = CutlassFp8GroupedGemm<kOut, kTile>;
  const Fp8GroupedGemmParams& p = *a.params;
  constexpr const char* kWhat = "CUTLASS FP8 grouped GEMM";
  MOE_XLA_RETURN_IF_ERROR(check_fp8_metadata<Config>(p.num_groups, a.workspace_bytes, kWhat));
  char* base = static_cast<char*>(a.workspace);
  const typename Config::Meta meta(base, typename Config::MetaLayout(p.num_groups));

  // Blocks of the prep kernel: enough to zero uncovered rows at full bandwidth (at most two
  // per SM), fewer when G is large, since each block reads all of group_sizes.
  const int64_t vecs = p.m * p.n * static_cast<int64_t>(sizeof(typename Config::ElementD)) / 16;
  const int64_t read_budget = std::max<int64_t>((int64_t{1} << 22) / p.num_groups, 1);
  const int64_t blocks =
      std::max<int64_t>(std::min({(vecs + kScanThreads - 1) / kScanThreads, 2 * int64_t{a.sm_count}, read_budget}), 1);
  cutlass_fp8_prep_kernel<Config><<<static_cast<unsigned>(blocks), kScanThreads, 0, a.stream>>>(p, meta);
  MOE_XLA_RETURN_IF_CUDA_ERROR(cudaGetLastError());  // launch of the prep kernel

  auto args = make_fp8_arguments<Config>(p.num_groups, a.sm_count, a.raster, a.team_clusters, a.team_waves, meta);
  return run_fp8_gemm<Config>(args, base, a.workspace_bytes, p.num_groups, a.stream, kWhat);
}

}  // namespace detail
}  // namespace cuda
}  // namespace moe_xla

#endif  // MOE_XLA_CUDA_CUTLASS_FP8_GROUPED_CUH_
