// Our Hopper kernel of the FP8 blockwise grouped product (common/fp8_grouped_gemm.h):
// out[r, n] = sum_j fl(lhs_scales[r, j] * rhs_scales[g, j, n / 128]) * P_j[r, n], one fma
// per 128-deep block j in block order, for the rows r of group g, walked as the row tiles
// of the table of cuda/row_tiles.h.
//
// Persistent clusters of two CTAs, one CTA per SM, walk the work units (fp8_unit_tile:
// a row tile and a pair of column tiles, one per CTA, ordered so that the clusters running
// at once share B tiles and A rows in L2); the two CTAs share the A tile, each loading half
// of its rows and multicasting them to both. Each CTA's output tile is 128 x kTileN
// (Fp8WgmmaTraits: 128 or 192 columns), computed in 128-deep K steps (one scale block, one
// 128-byte swizzle row of FP8) through a shared-memory pipeline by three warp groups:
//   - warp group 0, the producer: one thread loads per K step its half of the A tile
//     lhs[row_begin : row_begin + 128, k0 : k0 + 128] through a 2-D TMA descriptor of all of
//     lhs (rows past the tile's group are loaded too and never stored; TMA zero-fills past
//     M and K) and the B tile rhs[g, n0 : n0 + kTileN, k0 : k0 + 128] through a 3-D
//     descriptor of all of rhs (zero-filled past N and K), so no per-group descriptor is
//     needed.
//   - warp groups 1 and 2, the consumers: each multiplies its 64 rows of the tile by the B
//     tile with wgmma (m64 x kTileN x k32 FP8, K-major operands from shared memory): the
//     128-deep block sum P_j in float32 accumulators, promoted into the tile's float32
//     total, total = fma(fl(s_lhs * s_rhs), P, total). 128-column tiles keep two
//     accumulator sets that take turns: the wgmma of step j runs into one while the thread
//     promotes the other's P_{j-1}, so the tensor cores never wait for the promotion.
//     192-column tiles have registers for one set only: each warp group waits for its step
//     and promotes it while the other warp group's wgmma runs. A 192-column tile spans two
//     128-column scale blocks of rhs, split at column 128 (even tiles) or 64 (odd tiles).
//     A stage is freed as soon as the wgmma that read it is done.
//     Each thread loads the scales of its two rows and of the column tile's one or two
//     blocks for step j + 1 from global memory while step j runs (the producer staging them in shared memory
//     measured slower: benchmarks/results/LOG.md). After the last K step each warp group
//     stores its rows of the totals through a staging buffer in shared memory, 16 bytes
//     per thread and store (store_accumulators_staged; rows past the tile's group and
//     columns past N are left alone); with 192-column tiles, after issuing the next unit's
//     first wgmma, so that the tensor cores work through the store. Fp8WgmmaTile::kN192Bulk
//     instead stages the warp group's whole 64 x 192 bf16 tile and writes it with one bulk
//     copy per row (store_accumulators_bulk), which runs on through the next unit; its
//     buffers take the room of one pipeline stage (4 stages).
// The rows past the last group are zeroed by the table's kernel.
#ifndef MOE_XLA_CUDA_FP8_WGMMA_KERNEL_CUH_
#define MOE_XLA_CUDA_FP8_WGMMA_KERNEL_CUH_

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "cute/tensor.hpp"  // first: the atoms below rely on its declarations
#include "cute/algorithm/gemm.hpp"
#include "cute/arch/cluster_sm90.hpp"
#include "cute/atom/copy_traits_sm90_tma.hpp"
#include "cute/atom/mma_atom.hpp"
#include "cutlass/arch/barrier.h"
#include "cutlass/cutlass.h"
#include "cutlass/numeric_types.h"
#include "cutlass/pipeline/sm90_pipeline.hpp"

#include "common/fp8_blockwise.h"
#include "common/fp8_grouped_gemm.h"
#include "common/status.h"
#include "cuda/fp8_wgmma_internal.h"
#include "cuda/fp8_wgmma_scales.cuh"
#include "cuda/fp8_wgmma_tiles.cuh"
#include "cuda/row_tiles.h"
#include "cuda/wgmma_kernel_parts.cuh"

namespace moe_xla {
namespace cuda {
namespace detail {

// The stages that fit beside a tile's staging buffers in 227 KiB of shared memory.
constexpr int fp8_wgmma_stages(Fp8WgmmaTile tile) {
  return tile == Fp8WgmmaTile::kN192Bulk ? 4 : tile == Fp8WgmmaTile::kN128 ? 6 : 5;
}

template <Fp8WgmmaTile kTile, class Out>
struct Fp8WgmmaTraits : Fp8WgmmaTiles<fp8_wgmma_columns(kTile), fp8_wgmma_stages(kTile)> {
  using Base = Fp8WgmmaTiles<fp8_wgmma_columns(kTile), fp8_wgmma_stages(kTile)>;
  static_assert(Base::kTileM == kFp8WgmmaTileM, "the row-tile table's tiles");
  // A 128-column tile is one scale column block of rhs and has registers for two
  // accumulator sets; a 192-column tile spans two blocks and has one set.
  static constexpr bool kTwoAccumulators = Base::kTileN == fp8::kTile;
  // The output store: store_accumulators_bulk (whole bf16 rows) or _staged.
  static constexpr bool kBulkStore = kTile == Fp8WgmmaTile::kN192Bulk;
  static_assert(!kBulkStore || std::is_same_v<Out, __nv_bfloat16>, "the bulk store's buffers fit bf16 tiles");
  static constexpr uint32_t kTmaBytes = Base::kOperandBytes;

  using SharedStorage =
      WgmmaStagedSharedStorage<typename Base::Element, typename Base::SmemLayoutA, typename Base::SmemLayoutB,
                               typename Base::Pipeline,
                               kBulkStore ? 64 * bulk_staging_stride<Out, Base::kTileN>() : kStagingBytes>;
  static_assert(sizeof(SharedStorage) <= 232448, "an H100 / H200 CTA's shared memory");
};

template <class Out, class T>
struct Fp8WgmmaKernelParams {
  decltype(make_fp8_tma_a<T>(nullptr, 0, 0)) tma_a;
  decltype(make_fp8_tma_b<T>(nullptr, 0, 0, 0)) tma_b;
  const float* lhs_scales;  // [M, Kt]
  const float* rhs_scales;  // [G, Kt, Nt]
  const RowTile* row_tiles;
  const RowTileCount* tile_count;
  Out* out;
  int32_t m, k, n, num_groups;
  int32_t n_blocks, k_tiles;  // Nt and Kt: 128-column scale blocks of rhs, 128-deep steps
  int32_t n_tiles;            // kTileN-column tiles of out
  int32_t n_pairs;            // ceil(n_tiles / 2): the column-tile pairs of a cluster's units
};

// Unit u's row tile and column tile. A group of R row tiles owns units [first P,
// (first + R) P) (P = n_pairs), so u / P is one of its row tiles; inside the group the
// units go in fp8_band_place's order.
__device__ __forceinline__ RowTile fp8_unit_tile(const RowTile* row_tiles, int64_t unit, int32_t n_pairs,
                                                int32_t rank, int32_t* n_tile) {
  const int64_t t0 = unit / n_pairs;
  const RowTile any = row_tiles[t0];
  int64_t within;
  fp8_band_place(unit - static_cast<int64_t>(any.group_first) * n_pairs, any.group_tiles, n_pairs, rank, &within,
                 n_tile);
  const int64_t t = any.group_first + within;
  return t == t0 ? any : row_tiles[t];
}

// Warp group 0, thread 0 (see the header comment). `units` work units, this CTA's as
// fp8_unit_walk says.
template <class Out, class T>
__device__ __forceinline__ void fp8_wgmma_produce(const Fp8WgmmaKernelParams<Out, T>& p, typename T::SharedStorage& smem,
                                                  typename T::Pipeline& pipeline, int64_t units) {
  using namespace cute;
  prefetch_tma_descriptor(p.tma_a.get_tma_descriptor());
  prefetch_tma_descriptor(p.tma_b.get_tma_descriptor());
  Tensor mA = p.tma_a.get_tma_tensor(make_shape(p.m, p.k));                 // (M, K)
  Tensor sA = make_tensor(make_smem_ptr(smem.a.data()), typename T::SmemLayoutA{});  // (BLK_M, BLK_K, PIPE)
  auto [tBgB, tBsB] = tma_b_partition<T::kTileN, T::kTileK, typename T::SmemLayoutB>(
      p.tma_b, smem.b.data(), p.n, p.k, p.num_groups);  // (TMA, n, k, g), (TMA, PIPE)

  const Fp8UnitWalk walk = fp8_unit_walk();
  constexpr uint16_t kBothCtas = (1u << T::kClusterSize) - 1;
  typename T::PipelineState write = cutlass::make_producer_start_state<typename T::Pipeline>();
  for (int64_t unit = walk.first; unit < units; unit += walk.stride) {
    int32_t n_tile;
    const RowTile tile = fp8_unit_tile(p.row_tiles, unit, p.n_pairs, walk.rank, &n_tile);
    // The tile's rows start anywhere: lhs offset to row_begin, then 128-row blocks; this
    // CTA loads its half of the rows into both CTAs' stage.
    Tensor gA = local_tile(domain_offset(make_coord(tile.row_begin, 0), mA),
                           Shape<Int<T::kTileM>, Int<T::kTileK>>{}, make_coord(0, _));  // (BLK_M, BLK_K, k)
    auto [tAgA, tAsA] = tma_partition(p.tma_a, walk.rank, Layout<Int<T::kClusterSize>>{}, group_modes<0, 2>(sA),
                                      group_modes<0, 2>(gA));  // (TMA, k), (TMA, PIPE)
    for (int k_tile = 0; k_tile < p.k_tiles; ++k_tile) {
      pipeline.producer_acquire(write);  // and expects the stage's kTmaBytes (both halves of A)
      const int stage = write.index();
      auto* barrier = pipeline.producer_get_barrier(write);
      copy(p.tma_a.with(*barrier, kBothCtas), tAgA(_, k_tile), tAsA(_, stage));
      copy(p.tma_b.with(*barrier), tBgB(_, n_tile, k_tile, tile.group), tBsB(_, stage));
      ++write;
    }
  }
  // Stay until the consumers have freed every stage.
  pipeline.producer_tail(write);
}

// Warp groups 1 and 2 (see the header comment).
template <class Out, class T>
__device__ __forceinline__ void fp8_wgmma_consume(const Fp8WgmmaKernelParams<Out, T>& p,
                                                  typename T::SharedStorage& smem,
                                                  typename T::Pipeline& pipeline, int64_t units) {
  using namespace cute;
  const int thread = threadIdx.x - T::kProducerThreads;  // 0 .. kConsumerThreads - 1
  typename T::TiledMma mma;
  auto tensors = consumer_tensors<T>(mma, thread, smem);  // named below: lambdas capture them
  auto& tCrA = get<0>(tensors);
  auto& tCrB = get<1>(tensors);
  auto& acc0 = get<2>(tensors);
  auto& coord = get<3>(tensors);
  auto total = make_fragment_like(acc0);
  // The tile rows of this thread's values: i with (i & 2) == 0, and the others (r + 8).
  const int32_t row_lo = get<0>(coord(0)), row_hi = get<0>(coord(2));
  const StagingPlace place = staging_place(smem, thread);
  const Fp8UnitWalk walk = fp8_unit_walk();
  typename T::PipelineState read, release;

  // The next full stage's wgmma into `acc`, left in flight.
  auto issue = [&](auto& acc) {
    pipeline.consumer_wait(read);
    fp8_issue_stage(mma, tCrA, tCrB, acc, read.index());
    ++read;
  };
  // Once the oldest batch in flight (in `done`) has finished: free its stage, promote it.
  auto retire = [&](auto& done, const Fp8StepScales& s, bool split_64) {
    pipeline.consumer_release(release);
    ++release;
    fp8_promote_tile<T::kTileN>(total, done, s, split_64);
  };
  // The unit's tile, its first column and its scales.
  auto begin_unit = [&](int64_t unit, RowTile* tile, int32_t* col0) {
    int32_t n_tile;
    *tile = fp8_unit_tile(p.row_tiles, unit, p.n_pairs, walk.rank, &n_tile);
    *col0 = n_tile * T::kTileN;
    return Fp8UnitScales<!T::kTwoAccumulators>(p.lhs_scales, p.rhs_scales, p.m, p.n_blocks, p.k_tiles, *tile, *col0,
                                               row_lo, row_hi);
  };
  auto store = [&](const RowTile& tile, int32_t col0) {
    if constexpr (T::kBulkStore) {
      store_accumulators_bulk(p.out, p.n, tile.row_begin, tile.row_end, col0, total, coord, place);
    } else {
      store_accumulators_staged(p.out, p.n, tile.row_begin, tile.row_end, col0, total, coord, place);
    }
  };

  if constexpr (T::kTwoAccumulators) {
    auto acc1 = make_fragment_like(acc0);
    for (int64_t unit = walk.first; unit < units; unit += walk.stride) {
      RowTile tile;
      int32_t col0;
      auto scales = begin_unit(unit, &tile, &col0);
      clear(total);
      issue(acc0);
      Fp8StepScales pending = scales.take(0), newer;
      int j = 1;
      for (; j + 1 < p.k_tiles; j += 2) {
        issue(acc1);
        newer = scales.take(j);
        warpgroup_wait<1>();
        retire(acc0, pending, false);
        issue(acc0);
        pending = scales.take(j + 1);
        warpgroup_wait<1>();
        retire(acc1, newer, false);
      }
      if (j < p.k_tiles) {
        issue(acc1);
        newer = scales.take(j);
        warpgroup_wait<1>();
        retire(acc0, pending, false);
        warpgroup_wait<0>();
        retire(acc1, newer, false);
      } else {
        warpgroup_wait<0>();
        retire(acc0, pending, false);
      }
      store(tile, col0);
    }
  } else {
    // One accumulator set. A unit's first wgmma is issued before the previous unit's tile
    // is stored and before this unit's table entry and scales are read (the wgmma needs
    // only the stage), so the tensor cores work through the store and those loads.
    RowTile previous{};
    int32_t previous_col0 = 0;
    bool stored = true;  // whether `total` holds no unstored tile
    for (int64_t unit = walk.first; unit < units; unit += walk.stride) {
      issue(acc0);
      if (!stored) store(previous, previous_col0);
      RowTile tile;
      int32_t col0;
      auto scales = begin_unit(unit, &tile, &col0);
      const bool split_64 = col0 % static_cast<int32_t>(fp8::kTile) != 0;
      clear(total);
      Fp8StepScales s = scales.take(0);
      warpgroup_wait<0>();
      retire(acc0, s, split_64);
      for (int j = 1; j < p.k_tiles; ++j) {
        issue(acc0);
        s = scales.take(j);
        warpgroup_wait<0>();
        retire(acc0, s, split_64);
      }
      previous = tile;
      previous_col0 = col0;
      stored = false;
    }
    if (!stored) store(previous, previous_col0);
    if constexpr (T::kBulkStore) bulk_store_drain(place);
  }
}

template <class Out, class T>
__global__ void __launch_bounds__(T::kThreads, 1)
    fp8_wgmma_kernel(const __grid_constant__ Fp8WgmmaKernelParams<Out, T> p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ __align__(1024) char smem_raw[];  // the 128-byte swizzle needs 1024
  const int64_t units = p.tile_count->row_tiles * p.n_pairs;
  fp8_warp_groups<T>(
      smem_raw, [&](auto& smem, auto& pipeline) { fp8_wgmma_produce(p, smem, pipeline, units); },
      [&](auto& smem, auto& pipeline) { fp8_wgmma_consume(p, smem, pipeline, units); });
#endif
}

template <DType kOut, Fp8WgmmaTile kTile>
Status fp8_wgmma_run(const Fp8WgmmaLaunch& launch) {
  using Out = typename OutElement<kOut>::type;
  using T = Fp8WgmmaTraits<kTile, Out>;
  constexpr int kTileN = T::kTileN;
  const Fp8GroupedGemmParams& p = *launch.params;
  Fp8WgmmaKernelParams<Out, T> kp;
  const auto* lhs = reinterpret_cast<const cutlass::float_e4m3_t*>(p.lhs);
  const auto* rhs = reinterpret_cast<const cutlass::float_e4m3_t*>(p.rhs);
  kp.tma_a = make_fp8_tma_a<T>(lhs, static_cast<int32_t>(p.m), static_cast<int32_t>(p.k));
  kp.tma_b = make_fp8_tma_b<T>(rhs, static_cast<int32_t>(p.n), static_cast<int32_t>(p.k),
                               static_cast<int32_t>(p.num_groups));
  kp.lhs_scales = p.lhs_scales;
  kp.rhs_scales = p.rhs_scales;
  kp.row_tiles = launch.row_tiles.tiles;
  kp.tile_count = launch.row_tiles.count;
  kp.out = static_cast<Out*>(p.out);
  kp.m = static_cast<int32_t>(p.m);
  kp.k = static_cast<int32_t>(p.k);
  kp.n = static_cast<int32_t>(p.n);
  kp.num_groups = static_cast<int32_t>(p.num_groups);
  kp.n_blocks = static_cast<int32_t>(fp8::tiles(p.n));
  kp.k_tiles = static_cast<int32_t>(fp8::tiles(p.k));
  kp.n_tiles = static_cast<int32_t>((p.n + kTileN - 1) / kTileN);
  kp.n_pairs = (kp.n_tiles + T::kClusterSize - 1) / T::kClusterSize;
  return launch_persistent_clusters<T>(fp8_wgmma_kernel<Out, T>, kp, launch.row_tiles.max_tiles * kp.n_pairs,
                                       launch.stream);
}

}  // namespace detail
}  // namespace cuda
}  // namespace moe_xla

#endif  // MOE_XLA_CUDA_FP8_WGMMA_KERNEL_CUH_
