// Our Hopper kernel of the bf16 grouped product gmm (common/grouped_gemm.h, layout kGmm:
// out[r, :] = lhs[r, :] @ rhs[g] for the rows r of group g, float32 accumulation, rounded
// once to bf16) for a short K (K <= kResidentMaxK).
//
// With K that short, a tile's whole K loop is a few wgmma steps, so kernels that load A and
// B tiles per output tile spend as much time on B traffic (a K x 256 block of the expert's
// weights per tile) and on the tile's store as on the product. Here each work unit is one
// row tile of the row-tile table (at most kResidentUnitRows rows of one group) and one
// 256-column tile of the output. Its B block, rhs[g, 0 : K, n0 : n0 + 256], is loaded into
// shared memory once (four 64-deep chunks, each a stage of its own pipeline, so the first
// rows start on chunk 0 and a unit with K <= 128 loads the next unit's block beside it) and
// stays there while the unit's rows stream past in 64-row sub-tiles:
//   - warp group 0, the producer (one thread): per sub-tile, its rows lhs[r0 : r0 + 64,
//     0 : K] in 64 x 64 TMA boxes through an 8-stage pipeline (rows past the unit's group
//     are loaded too and never stored; TMA zero-fills past M and K); at a unit's first
//     sub-tile, the unit's B chunks beside the A chunks (zero-filled past K and N).
//   - warp groups 1 and 2, the consumers, take the sub-tiles in turn (sub-tile q of the
//     CTA is warp group q % 2's): a warp group waits for its turn (named barriers 3 and 4),
//     issues the sub-tile's wgmma (m64 x n256 x k16, A K-major, B N-major from shared
//     memory), hands the turn to the other warp group, waits for its own wgmma and stores
//     the 64 x 256 tile (store_accumulators_staged: rows past the group and columns past N
//     are left alone). The tensor cores thus run one warp group's sub-tile while the other
//     stores the previous one.
// The output rows past the last group are zeroed by the row-tile table's kernel.
#ifndef MOE_XLA_CUDA_RESIDENT_B_GEMM_KERNEL_CUH_
#define MOE_XLA_CUDA_RESIDENT_B_GEMM_KERNEL_CUH_

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cute/tensor.hpp"  // first: the atoms below rely on its declarations
#include "cute/algorithm/gemm.hpp"
#include "cute/atom/copy_traits_sm90_tma.hpp"
#include "cute/atom/mma_atom.hpp"
#include "cutlass/arch/barrier.h"
#include "cutlass/arch/reg_reconfig.h"
#include "cutlass/cutlass.h"
#include "cutlass/numeric_types.h"
#include "cutlass/pipeline/sm90_pipeline.hpp"

#include "common/grouped_gemm.h"
#include "common/status.h"
#include "cuda/resident_b_gemm_internal.h"
#include "cuda/row_tiles.h"
#include "cuda/wgmma_kernel_parts.cuh"

namespace moe_xla {
namespace cuda {
namespace detail {

struct ResidentBTraits : ProducerConsumerWarpGroups<> {
  using Element = cutlass::bfloat16_t;
  using Out = __nv_bfloat16;
  static constexpr int kTileM = 64;  // a sub-tile: one consumer warp group's rows
  static constexpr int kTileN = kResidentTileN;
  static constexpr int kTileK = 64;  // one 128-byte swizzle row of bf16
  static constexpr int kChunks = kResidentMaxK / kTileK;  // B's stages
  static constexpr int kStagesA = 8;                       // two sub-tiles of K 256 in flight

  using SmemLayoutA = decltype(cute::tile_to_shape(
      cute::GMMA::Layout_K_SW128_Atom<Element>{},
      cute::make_shape(cute::Int<kTileM>{}, cute::Int<kTileK>{}, cute::Int<kStagesA>{})));
  // N-major (rhs [G, K, N] has N contiguous): the atoms go along K first, as GMMA's
  // canonical MN-major layout has them.
  using SmemLayoutB = decltype(cute::tile_to_shape(
      cute::GMMA::Layout_MN_SW128_Atom<Element>{},
      cute::make_shape(cute::Int<kTileN>{}, cute::Int<kTileK>{}, cute::Int<kChunks>{}),
      cute::Step<cute::_2, cute::_1, cute::_3>{}));

  // One warp group per 64 x 256 sub-tile.
  using TiledMma = decltype(cute::make_tiled_mma(
      cute::SM90_64x256x16_F32BF16BF16_SS<cute::GMMA::Major::K, cute::GMMA::Major::MN>{}));
  static_assert(cute::size(TiledMma{}) == 128, "one warp group per sub-tile");

  using PipelineA = cutlass::PipelineTmaAsync<kStagesA>;
  using PipelineB = cutlass::PipelineTmaAsync<kChunks>;
  static constexpr uint32_t kBytesA = kTileM * kTileK * sizeof(Element);
  static constexpr uint32_t kBytesB = kTileN * kTileK * sizeof(Element);

  struct SharedStorage {
    alignas(1024) cute::array_aligned<Element, cute::cosize_v<SmemLayoutA>, 1024> a;
    alignas(1024) cute::array_aligned<Element, cute::cosize_v<SmemLayoutB>, 1024> b;
    typename PipelineA::SharedStorage pipeline_a;
    typename PipelineB::SharedStorage pipeline_b;
    alignas(16) char staging[2][kStagingBytes];
  };
  static_assert(sizeof(SharedStorage) <= 232448, "an H100 / H200 CTA's shared memory");
};

// Named barriers of the consumers' turns: warp group g waits on kTurnBarrier + g (ids 1
// and 2 are the staging buffers').
constexpr int kTurnBarrier = 3;

// The TMA loads: lhs viewed as (M, K), K contiguous; rhs [G, K, N] as (N, K, G), N
// contiguous.
template <class T>
auto make_resident_tma_a(const typename T::Element* lhs, int32_t m, int32_t k) {
  auto tensor = cute::make_tensor(cute::make_gmem_ptr(lhs), cute::make_shape(m, k),
                                  cute::make_stride(int64_t{k}, cute::_1{}));
  return cute::make_tma_copy(cute::SM90_TMA_LOAD{}, tensor, typename T::SmemLayoutA{}(cute::_, cute::_, cute::Int<0>{}),
                             cute::make_shape(cute::Int<T::kTileM>{}, cute::Int<T::kTileK>{}), cute::Int<1>{});
}
template <class T>
auto make_resident_tma_b(const typename T::Element* rhs, int32_t k, int32_t n, int32_t groups) {
  auto tensor = cute::make_tensor(cute::make_gmem_ptr(rhs), cute::make_shape(n, k, groups),
                                  cute::make_stride(cute::_1{}, int64_t{n}, int64_t{k} * n));
  return cute::make_tma_copy(cute::SM90_TMA_LOAD{}, tensor, typename T::SmemLayoutB{}(cute::_, cute::_, cute::Int<0>{}),
                             cute::make_shape(cute::Int<T::kTileN>{}, cute::Int<T::kTileK>{}), cute::Int<1>{});
}

template <class T>
struct ResidentBKernelParams {
  decltype(make_resident_tma_a<T>(nullptr, 0, 0)) tma_a;
  decltype(make_resident_tma_b<T>(nullptr, 0, 0, 0)) tma_b;
  const RowTile* row_tiles;
  const RowTileCount* tile_count;
  typename T::Out* out;
  int32_t m, k, n, num_groups;
  int32_t chunks;   // ceil(K / 64): the 64-deep steps of a sub-tile
  int32_t n_tiles;  // 256-column tiles of out
};

// The 64-row sub-tiles of a row tile: ceil(rows / 64), at least 1 (row tiles are never
// empty).
__device__ __forceinline__ int32_t resident_sub_tiles(const RowTile& tile) {
  return (tile.row_end - tile.row_begin + 63) / 64;
}

// Warp group 0, thread 0 (see the header comment). The grid walks units u = blockIdx.x, +
// gridDim.x, ...: row tile u / n_tiles, column tile u % n_tiles, so the CTAs running at once
// share each row tile's rows in L2.
template <class T>
__device__ __forceinline__ void resident_b_produce(const ResidentBKernelParams<T>& p, typename T::SharedStorage& smem,
                                                   typename T::PipelineA& pipeline_a, typename T::PipelineB& pipeline_b,
                                                   int64_t units) {
  using namespace cute;
  prefetch_tma_descriptor(p.tma_a.get_tma_descriptor());
  prefetch_tma_descriptor(p.tma_b.get_tma_descriptor());
  Tensor mA = p.tma_a.get_tma_tensor(make_shape(p.m, p.k));                 // (M, K)
  Tensor sA = make_tensor(make_smem_ptr(smem.a.data()), typename T::SmemLayoutA{});  // (BLK_M, BLK_K, PIPE)
  auto [tBgB, tBsB] = tma_b_partition<T::kTileN, T::kTileK, typename T::SmemLayoutB>(
      p.tma_b, smem.b.data(), p.n, p.k, p.num_groups);  // (TMA, n, k, g), (TMA, CHUNK)

  typename T::PipelineA::PipelineState write_a = cutlass::make_producer_start_state<typename T::PipelineA>();
  typename T::PipelineB::PipelineState write_b = cutlass::make_producer_start_state<typename T::PipelineB>();
  for (int64_t unit = blockIdx.x; unit < units; unit += gridDim.x) {
    const RowTile tile = p.row_tiles[unit / p.n_tiles];
    const int32_t n_tile = static_cast<int32_t>(unit % p.n_tiles);
    const int32_t sub_tiles = resident_sub_tiles(tile);
    for (int32_t s = 0; s < sub_tiles; ++s) {
      Tensor gA = local_tile(domain_offset(make_coord(tile.row_begin + 64 * s, 0), mA),
                             Shape<Int<T::kTileM>, Int<T::kTileK>>{}, make_coord(0, _));  // (BLK_M, BLK_K, k)
      auto [tAgA, tAsA] = tma_partition(p.tma_a, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sA),
                                        group_modes<0, 2>(gA));  // (TMA, k), (TMA, PIPE)
      for (int32_t c = 0; c < p.chunks; ++c) {
        pipeline_a.producer_acquire(write_a);
        copy(p.tma_a.with(*pipeline_a.producer_get_barrier(write_a)), tAgA(_, c), tAsA(_, write_a.index()));
        ++write_a;
        if (s == 0) {  // the unit's B chunk c, right behind the A chunk that needs it first
          pipeline_b.producer_acquire(write_b);
          copy(p.tma_b.with(*pipeline_b.producer_get_barrier(write_b)), tBgB(_, n_tile, c, tile.group),
               tBsB(_, write_b.index()));
          ++write_b;
        }
      }
    }
  }
  // Stay until the consumers have freed every stage.
  pipeline_a.producer_tail(write_a);
  pipeline_b.producer_tail(write_b);
}

// Warp groups 1 and 2 (see the header comment).
template <class T>
__device__ __forceinline__ void resident_b_consume(const ResidentBKernelParams<T>& p, typename T::SharedStorage& smem,
                                                   typename T::PipelineA& pipeline_a, typename T::PipelineB& pipeline_b,
                                                   int64_t units) {
  using namespace cute;
  const int thread = threadIdx.x - T::kProducerThreads;  // 0 .. kConsumerThreads - 1
  const int group = thread / 128;
  typename T::TiledMma mma;
  auto tensors = consumer_tensors<T>(mma, thread % 128, smem);
  auto& tCrA = get<0>(tensors);  // (MMA, M, K, PIPE)
  auto& tCrB = get<1>(tensors);  // (MMA, N, K, CHUNK)
  auto& accum = get<2>(tensors);
  auto& coord = get<3>(tensors);
  const StagingPlace place = staging_place(smem, thread);
  auto wait_turn = [group] { asm volatile("bar.sync %0, 256;\n" ::"r"(kTurnBarrier + group) : "memory"); };
  auto give_turn = [group] { asm volatile("bar.arrive %0, 256;\n" ::"r"(kTurnBarrier + 1 - group) : "memory"); };

  typename T::PipelineA::PipelineState read_a;
  typename T::PipelineB::PipelineState read_b;
  int64_t turn = 0;               // sub-tiles of this CTA so far; sub-tile q is warp group q % 2's
  if (group == 1) give_turn();    // the first turn is warp group 0's
  for (int64_t unit = blockIdx.x; unit < units; unit += gridDim.x) {
    const RowTile tile = p.row_tiles[unit / p.n_tiles];
    const int32_t col0 = static_cast<int32_t>(unit % p.n_tiles) * T::kTileN;
    const int32_t sub_tiles = resident_sub_tiles(tile);
    for (int32_t s = 0; s < sub_tiles; ++s, ++turn) {
      if ((turn & 1) != group) {  // the other warp group's sub-tile
        read_a.advance(p.chunks);
        continue;
      }
      // The turn comes before the stage waits: with 3 chunks per sub-tile an A stage passes
      // from one warp group to the other, and its phase bit tells this fill from the next
      // only once the fill before it has been waited for by its own warp group, which the
      // turn order guarantees.
      wait_turn();
      typename T::PipelineA::PipelineState release_a = read_a;
      typename T::PipelineB::PipelineState chunk = read_b;
      mma.accumulate_ = GMMA::ScaleOut::Zero;
      warpgroup_fence_operand(accum);
      for (int32_t c = 0; c < p.chunks; ++c) {
        pipeline_a.consumer_wait(read_a);
        pipeline_b.consumer_wait(chunk);
        warpgroup_arrive();
        CUTLASS_PRAGMA_UNROLL
        for (int k_block = 0; k_block < size<2>(tCrA); ++k_block) {
          gemm(mma, tCrA(_, _, k_block, read_a.index()), tCrB(_, _, k_block, chunk.index()), accum);
          mma.accumulate_ = GMMA::ScaleOut::One;
        }
        warpgroup_commit_batch();
        ++read_a;
        ++chunk;
      }
      give_turn();
      warpgroup_wait<0>();
      warpgroup_fence_operand(accum);
      for (int32_t c = 0; c < p.chunks; ++c) {
        pipeline_a.consumer_release(release_a);
        ++release_a;
      }
      store_accumulators_staged(p.out, p.n, tile.row_begin + 64 * s, tile.row_end, col0, accum, coord, place);
    }
    // Both warp groups free the unit's B block once their own wgmma are done (a warp group
    // with no sub-tile here first waits for the block, so that it frees this unit's).
    for (int32_t c = 0; c < p.chunks; ++c) {
      pipeline_b.consumer_wait(read_b);
      pipeline_b.consumer_release(read_b);
      ++read_b;
    }
  }
  // The turn after the last one is pending on its warp group's barrier: take it, so that no
  // arrival outlives the kernel.
  if ((turn & 1) == group) wait_turn();
}

template <class T>
__global__ void __launch_bounds__(T::kThreads, 1)
    resident_b_gemm_kernel(const __grid_constant__ ResidentBKernelParams<T> p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ __align__(1024) char smem_raw[];  // the 128-byte swizzle needs 1024
  auto& smem = *reinterpret_cast<typename T::SharedStorage*>(smem_raw);
  const bool producer = cutlass::canonical_warp_group_idx() == 0;

  using OneCta = cute::Shape<cute::_1, cute::_1, cute::_1>;
  // Each A stage is read by one warp group, the B chunks by both.
  auto pipeline_a = make_stage_pipeline<typename T::PipelineA>(smem.pipeline_a, producer, T::kBytesA,
                                                                T::kConsumerThreads / 2, OneCta{});
  auto pipeline_b =
      make_stage_pipeline<typename T::PipelineB>(smem.pipeline_b, producer, T::kBytesB, T::kConsumerThreads, OneCta{});
  __syncthreads();  // the barriers initialised before any thread uses them

  const int64_t units = p.tile_count->row_tiles * p.n_tiles;
  if (producer) {
    cutlass::arch::warpgroup_reg_dealloc<T::kProducerRegisters>();
    if (threadIdx.x == 0) resident_b_produce(p, smem, pipeline_a, pipeline_b, units);
  } else {
    cutlass::arch::warpgroup_reg_alloc<T::kConsumerRegisters>();
    resident_b_consume(p, smem, pipeline_a, pipeline_b, units);
  }
#endif
}

template <DType kDType>
Status resident_b_gemm_run(const ResidentBLaunch& launch) {
  static_assert(kDType == DType::kBF16, "the traits' wgmma and outputs are bf16");
  using T = ResidentBTraits;
  const GroupedGemmParams& p = *launch.params;
  ResidentBKernelParams<T> kp;
  const auto* lhs = static_cast<const typename T::Element*>(p.lhs);
  const auto* rhs = static_cast<const typename T::Element*>(p.rhs);
  kp.m = static_cast<int32_t>(p.m);
  kp.k = static_cast<int32_t>(p.k);
  kp.n = static_cast<int32_t>(p.n);
  kp.num_groups = static_cast<int32_t>(p.num_groups);
  kp.tma_a = make_resident_tma_a<T>(lhs, kp.m, kp.k);
  kp.tma_b = make_resident_tma_b<T>(rhs, kp.k, kp.n, kp.num_groups);
  kp.row_tiles = launch.row_tiles.tiles;
  kp.tile_count = launch.row_tiles.count;
  kp.out = static_cast<typename T::Out*>(p.out);
  kp.chunks = (kp.k + T::kTileK - 1) / T::kTileK;
  kp.n_tiles = (kp.n + T::kTileN - 1) / T::kTileN;
  return launch_persistent<T>(resident_b_gemm_kernel<T>, kp, launch.row_tiles.max_tiles * kp.n_tiles,
                              launch.sm_count, launch.stream);
}

}  // namespace detail
}  // namespace cuda
}  // namespace moe_xla

#endif  // MOE_XLA_CUDA_RESIDENT_B_GEMM_KERNEL_CUH_
