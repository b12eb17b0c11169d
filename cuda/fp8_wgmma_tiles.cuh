// The pieces our two Hopper FP8 kernels share, the grouped product (fp8_wgmma_kernel.cuh)
// and the wgrad (fp8_wgrad_wgmma_kernel.cuh): clusters of two CTAs that share the A tile
// (each loads half of its rows and multicasts them to both) and compute a pair of column
// tiles of one 128-row tile, in 128-deep steps (one FP8 scale block, one 128-byte swizzle
// row) of K-major operands through a TMA pipeline; the walk over work units and their band
// order; the wgmma of one stage; the kernel body that splits the warp groups.
#ifndef MOE_XLA_CUDA_FP8_WGMMA_TILES_CUH_
#define MOE_XLA_CUDA_FP8_WGMMA_TILES_CUH_

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "cute/tensor.hpp"  // first: the atoms below rely on its declarations
#include "cute/algorithm/gemm.hpp"
#include "cute/arch/cluster_sm90.hpp"
#include "cute/atom/copy_traits_sm90_tma.hpp"
#include "cute/atom/mma_atom.hpp"
#include "cutlass/arch/reg_reconfig.h"
#include "cutlass/cutlass.h"
#include "cutlass/numeric_types.h"
#include "cutlass/pipeline/sm90_pipeline.hpp"

#include "common/fp8_blockwise.h"
#include "cuda/wgmma_kernel_parts.cuh"

namespace moe_xla {
namespace cuda {
namespace detail {

// CTAs per cluster.
constexpr int kFp8ClusterSize = 2;

// The tiles of a kernel with 128 x kTileN_ output tiles (128 or 192 columns) and kStages_
// pipeline stages: both operands K-major (FP8 wgmma takes no other) with the 128-byte
// swizzle, two consumer warp groups along M of 64 x kTileN_ each.
template <int kTileN_, int kStages_>
struct Fp8WgmmaTiles : ProducerConsumerWarpGroups<> {
  using Element = cutlass::float_e4m3_t;
  static constexpr int kTileM = fp8::kTile;
  static constexpr int kTileN = kTileN_;
  static constexpr int kTileK = fp8::kTile;  // one scale block, one 128-byte swizzle row
  static_assert(kTileN == fp8::kTile || kTileN == 3 * fp8::kTile / 2, "128 or 192 columns");
  static constexpr int kStages = kStages_;
  static constexpr int kClusterSize = kFp8ClusterSize;
  using ClusterShape = cute::Shape<cute::Int<kClusterSize>, cute::_1, cute::_1>;

  using SmemLayoutA = decltype(cute::tile_to_shape(
      cute::GMMA::Layout_K_SW128_Atom<Element>{},
      cute::make_shape(cute::Int<kTileM>{}, cute::Int<kTileK>{}, cute::Int<kStages>{})));
  using SmemLayoutB = decltype(cute::tile_to_shape(
      cute::GMMA::Layout_K_SW128_Atom<Element>{},
      cute::make_shape(cute::Int<kTileN>{}, cute::Int<kTileK>{}, cute::Int<kStages>{})));

  using MmaAtom = std::conditional_t<kTileN == fp8::kTile, cute::SM90_64x128x32_F32E4M3E4M3_SS_TN<>,
                                     cute::SM90_64x192x32_F32E4M3E4M3_SS_TN<>>;
  using TiledMma = decltype(cute::make_tiled_mma(MmaAtom{}, cute::Layout<cute::Shape<cute::_2, cute::_1, cute::_1>>{}));
  static_assert(cute::size(TiledMma{}) == kConsumerThreads, "two consumer warp groups");

  using Pipeline = cutlass::PipelineTmaAsync<kStages>;
  using PipelineState = typename Pipeline::PipelineState;
  // The operand bytes of one stage (A and B tiles).
  static constexpr uint32_t kOperandBytes = (kTileM + kTileN) * kTileK * sizeof(Element);
};

// The TMA loads of the operands into one stage of the A and B layouts: A viewed as
// (M, K), multicast over the cluster (each CTA loads half of the box's rows), and B as
// (N, K, G), both K contiguous.
template <class T>
auto make_fp8_tma_a(const cutlass::float_e4m3_t* lhs, int32_t m, int32_t k) {
  auto tensor = cute::make_tensor(cute::make_gmem_ptr(lhs), cute::make_shape(m, k),
                                  cute::make_stride(int64_t{k}, cute::_1{}));
  return cute::make_tma_copy(cute::SM90_TMA_LOAD_MULTICAST{}, tensor,
                             typename T::SmemLayoutA{}(cute::_, cute::_, cute::Int<0>{}),
                             cute::make_shape(cute::Int<T::kTileM>{}, cute::Int<T::kTileK>{}),
                             cute::Int<T::kClusterSize>{});
}
template <class T>
auto make_fp8_tma_b(const cutlass::float_e4m3_t* rhs, int32_t n, int32_t k, int32_t groups) {
  auto tensor = cute::make_tensor(cute::make_gmem_ptr(rhs), cute::make_shape(n, k, groups),
                                  cute::make_stride(int64_t{k}, cute::_1{}, int64_t{n} * k));
  return cute::make_tma_copy(cute::SM90_TMA_LOAD{}, tensor, typename T::SmemLayoutB{}(cute::_, cute::_, cute::Int<0>{}),
                             cute::make_shape(cute::Int<T::kTileN>{}, cute::Int<T::kTileK>{}), cute::Int<1>{});
}

// The work units of this CTA: u = cluster, + clusters, ... < units, each a row tile and
// a pair of column tiles (one per CTA of the cluster).
struct Fp8UnitWalk {
  int64_t first, stride;
  int32_t rank;  // in the cluster: which column tile of the pair
};
__device__ __forceinline__ Fp8UnitWalk fp8_unit_walk() {
  const uint32_t rank = cute::block_rank_in_cluster();
  return Fp8UnitWalk{blockIdx.x / kFp8ClusterSize, gridDim.x / kFp8ClusterSize, static_cast<int32_t>(rank)};
}

// Row tiles per band of the unit order below.
constexpr int kFp8BandTiles = 16;

// The band order of the `tiles` x n_pairs units of one operand pair (a group): unit
// `local` (0 .. tiles * n_pairs - 1) is row tile *tile and column tile *n_tile of this
// CTA (`rank` in the cluster). The units go band by band (kFp8BandTiles row tiles), and in
// a band column pair by column pair over its row tiles: the clusters running at once share
// each B tile across a band's row tiles (B is read from memory about once per band) while
// the band's A rows stay in L2 from one column pair to the next.
__device__ __forceinline__ void fp8_band_place(int64_t local, int64_t tiles, int32_t n_pairs, int32_t rank,
                                               int64_t* tile, int32_t* n_tile) {
  const int64_t band = local / (static_cast<int64_t>(kFp8BandTiles) * n_pairs);
  const int64_t within = local - band * kFp8BandTiles * n_pairs;
  const int64_t band_tiles = std::min<int64_t>(kFp8BandTiles, tiles - band * kFp8BandTiles);
  *tile = band * kFp8BandTiles + within % band_tiles;
  *n_tile = static_cast<int32_t>(within / band_tiles) * kFp8ClusterSize + rank;
}

// The wgmma of one stage into `acc` (overwritten: the 128-deep block sum P of the stage),
// committed as one batch and left in flight.
template <class TiledMma, class FragA, class FragB, class Accum>
__device__ __forceinline__ void fp8_issue_stage(TiledMma& mma, const FragA& tCrA, const FragB& tCrB, Accum& acc,
                                                int stage) {
  using namespace cute;
  warpgroup_fence_operand(acc);
  warpgroup_arrive();
  mma.accumulate_ = GMMA::ScaleOut::Zero;
  CUTLASS_PRAGMA_UNROLL
  for (int k_block = 0; k_block < size<2>(tCrA); ++k_block) {
    gemm(mma, tCrA(_, _, k_block, stage), tCrB(_, _, k_block, stage), acc);
    mma.accumulate_ = GMMA::ScaleOut::One;
  }
  warpgroup_commit_batch();
}

// The body of a kernel of traits T (kTmaBytes per stage, SharedStorage with the pipeline's
// barriers in `pipeline`) in dynamic shared memory `smem_raw`: sets up the stage pipeline
// of the cluster, then warp group 0 gives up registers and its thread 0 runs
// produce(smem, pipeline), the consumer warp groups take them and run consume(smem,
// pipeline).
template <class T, class Produce, class Consume>
__device__ __forceinline__ void fp8_warp_groups(char* smem_raw, const Produce& produce, const Consume& consume) {
  auto& smem = *reinterpret_cast<typename T::SharedStorage*>(smem_raw);
  const bool producer = cutlass::canonical_warp_group_idx() == 0;
  auto pipeline = make_stage_pipeline<typename T::Pipeline>(smem.pipeline, producer, T::kTmaBytes,
                                                            T::kConsumerThreads, typename T::ClusterShape{});
  // Both CTAs' barriers initialised before any thread of the cluster uses them.
  cute::cluster_arrive_relaxed();
  cute::cluster_wait();
  if (producer) {
    cutlass::arch::warpgroup_reg_dealloc<T::kProducerRegisters>();
    if (threadIdx.x == 0) produce(smem, pipeline);
  } else {
    cutlass::arch::warpgroup_reg_alloc<T::kConsumerRegisters>();
    consume(smem, pipeline);
  }
}

}  // namespace detail
}  // namespace cuda
}  // namespace moe_xla

#endif  // MOE_XLA_CUDA_FP8_WGMMA_TILES_CUH_
