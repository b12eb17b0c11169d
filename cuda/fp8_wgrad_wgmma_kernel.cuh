// Our Hopper kernel of the FP8 wgrad (Fp8WgradParams, common/fp8_grouped_gemm.h): for
// each group g and its tiles t (first(g) .. first(g) + count(g) - 1, 128 columns each of
// lhs_t [K, 128 T] and rhs_t [N, 128 T]),
//   P_t[k, n] = sum over the tile's columns c of lhs_t[k, c] rhs_t[n, c]
//   out[g, k, n] = acc after acc = fma(fl(P_t[k, n] * lhs_scales[t, k]), rhs_scales[t, n], acc)
// over the tiles in order (acc 0 before the first, so a group with no tiles is 0).
//
// The clusters, tiles and pipeline of fp8_wgmma_tiles.cuh, with the group's tiles as the
// 128-deep steps. A work unit is a group, a 128-row tile of out[g] (rows of K) and a pair
// of kTileN-column tiles (columns of N), one per CTA of the cluster; units go group by
// group and in a group in fp8_band_place's order. Each CTA walks its units persistently:
//   - warp group 0, the producer: one thread loads per step t its half of the A tile
//     lhs_t[k0 : k0 + 128, 128 t : 128 t + 128] (multicast to both CTAs), the B tile
//     rhs_t[n0 : n0 + kTileN, 128 t : 128 t + 128], and the step's scales
//     lhs_scales[t, k0 : k0 + 128] and rhs_scales[t, n0 : n0 + kTileN] into the stage, all
//     by TMA (zero-filled past K and N: those rows and columns are never stored). Groups
//     start at whole tiles and the operands' columns of no row are 0, so a step needs no
//     masking.
//   - warp groups 1 and 2, the consumers: each multiplies its 64 rows by the B tile with
//     wgmma (m64 x kTileN x k32, four per step) into one float32 accumulator set, P_t,
//     waits for it and promotes it into the tile's total with the step's scales from
//     shared memory (per row and per column: the thread's two rows, and each column pair of
//     its fragment as one 8-byte load), then frees the stage. While one warp group
//     promotes, the other's wgmma runs. After a unit's last step the next unit's first
//     wgmma is issued before the tile is stored (store_accumulators_staged, rows past K and
//     columns past N left alone), so the tensor cores work through the store.
#ifndef MOE_XLA_CUDA_FP8_WGRAD_WGMMA_KERNEL_CUH_
#define MOE_XLA_CUDA_FP8_WGRAD_WGMMA_KERNEL_CUH_

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "cute/tensor.hpp"  // first: the atoms below rely on its declarations
#include "cute/algorithm/gemm.hpp"
#include "cute/arch/cluster_sm90.hpp"
#include "cute/atom/copy_traits_sm90_tma.hpp"
#include "cute/atom/mma_atom.hpp"
#include "cutlass/arch/barrier.h"
#include "cutlass/cutlass.h"
#include "cutlass/pipeline/sm90_pipeline.hpp"

#include "common/fp8_blockwise.h"
#include "common/fp8_grouped_gemm.h"
#include "common/status.h"
#include "cuda/fp8_wgmma_tiles.cuh"
#include "cuda/fp8_wgrad_wgmma_internal.h"
#include "cuda/wgmma_kernel_parts.cuh"

namespace moe_xla {
namespace cuda {
namespace detail {

constexpr int fp8_wgrad_columns(Fp8WgradTile tile) { return tile == Fp8WgradTile::kN128 ? 128 : 192; }

// As many stages as fit beside the scales and the staging buffers in 227 KiB.
constexpr int fp8_wgrad_stages(Fp8WgradTile tile) { return tile == Fp8WgradTile::kN128 ? 6 : 5; }

template <Fp8WgradTile kTile>
struct Fp8WgradTraits : Fp8WgmmaTiles<fp8_wgrad_columns(kTile), fp8_wgrad_stages(kTile)> {
  using Base = Fp8WgmmaTiles<fp8_wgrad_columns(kTile), fp8_wgrad_stages(kTile)>;
  // A stage: the operand tiles and the step's scales of the tile's rows and columns.
  static constexpr uint32_t kTmaBytes = Base::kOperandBytes + (Base::kTileM + Base::kTileN) * sizeof(float);

  // The fields in this order waste no padding: the 192-column tile's five stages fit.
  struct SharedStorage {
    alignas(1024) cute::array_aligned<typename Base::Element, cute::cosize_v<typename Base::SmemLayoutA>, 1024> a;
    alignas(1024) cute::array_aligned<typename Base::Element, cute::cosize_v<typename Base::SmemLayoutB>, 1024> b;
    alignas(128) float scale_a[Base::kStages][Base::kTileM];
    alignas(128) float scale_b[Base::kStages][Base::kTileN];
    typename Base::Pipeline::SharedStorage pipeline;
    alignas(16) char staging[2][kStagingBytes];
  };
  static_assert(sizeof(SharedStorage) <= 232448, "an H100 / H200 CTA's shared memory");
};

// The TMA load of one step's scales: scales [T, cols] viewed as (cols, T), in boxes of
// kBox x 1 into a stage of kBox floats. TMA needs cols % 4 == 0 (16-byte row stride).
template <int kBox>
auto make_fp8_tma_scales(const float* scales, int32_t cols, int32_t tiles) {
  using namespace cute;
  auto tensor = make_tensor(make_gmem_ptr(scales), make_shape(cols, tiles), make_stride(_1{}, int64_t{cols}));
  auto box = make_layout(make_shape(Int<kBox>{}, _1{}));
  return make_tma_copy(SM90_TMA_LOAD{}, tensor, box, make_shape(Int<kBox>{}, _1{}), Int<1>{});
}

template <class Out, class T>
struct Fp8WgradKernelParams {
  decltype(make_fp8_tma_a<T>(nullptr, 0, 0)) tma_a;                     // lhs_t as (K, 128 T)
  decltype(make_fp8_tma_b<T>(nullptr, 0, 0, 0)) tma_b;                  // rhs_t as (N, 128 T, 1)
  decltype(make_fp8_tma_scales<T::kTileM>(nullptr, 0, 0)) tma_scale_a;  // lhs_scales as (K, T)
  decltype(make_fp8_tma_scales<T::kTileN>(nullptr, 0, 0)) tma_scale_b;  // rhs_scales as (N, T)
  const int64_t* group_tiles;                                           // [G][2]: first, count
  Out* out;
  int32_t k, n, num_groups;
  int32_t width, tiles;  // width = 128 tiles
  int32_t k_tiles;             // 128-row tiles of out[g]
  int32_t n_pairs;             // pairs of kTileN-column tiles
};

// What a work unit computes: out[group] rows row0 .., columns col0 .., from `steps` tiles
// starting at `first`; k_tile and n_tile are row0 / 128 and col0 / kTileN.
struct Fp8WgradUnit {
  int32_t first, steps;  // below T, in int32 (the dispatcher's range check)
  int32_t group, k_tile, n_tile;
};

template <class Out, class T>
__device__ __forceinline__ Fp8WgradUnit fp8_wgrad_unit(const Fp8WgradKernelParams<Out, T>& p, int64_t unit,
                                                       int32_t rank) {
  const int64_t per_group = static_cast<int64_t>(p.k_tiles) * p.n_pairs;
  Fp8WgradUnit u;
  u.group = static_cast<int32_t>(unit / per_group);
  int64_t k_tile;
  fp8_band_place(unit - u.group * per_group, p.k_tiles, p.n_pairs, rank, &k_tile, &u.n_tile);
  u.k_tile = static_cast<int32_t>(k_tile);
  u.first = static_cast<int32_t>(p.group_tiles[2 * u.group]);
  u.steps = static_cast<int32_t>(p.group_tiles[2 * u.group + 1]);
  return u;
}

// Warp group 0, thread 0 (see the header comment).
template <class Out, class T>
__device__ __forceinline__ void fp8_wgrad_produce(const Fp8WgradKernelParams<Out, T>& p,
                                                  typename T::SharedStorage& smem, typename T::Pipeline& pipeline,
                                                  int64_t units) {
  using namespace cute;
  prefetch_tma_descriptor(p.tma_a.get_tma_descriptor());
  prefetch_tma_descriptor(p.tma_b.get_tma_descriptor());
  prefetch_tma_descriptor(p.tma_scale_a.get_tma_descriptor());
  prefetch_tma_descriptor(p.tma_scale_b.get_tma_descriptor());
  const Fp8UnitWalk walk = fp8_unit_walk();

  Tensor mA = p.tma_a.get_tma_tensor(make_shape(p.k, p.width));                        // (K, W)
  Tensor gA = local_tile(mA, Shape<Int<T::kTileM>, Int<T::kTileK>>{}, make_coord(_, _));  // (BLK_M, BLK_K, m, t)
  Tensor sA = make_tensor(make_smem_ptr(smem.a.data()), typename T::SmemLayoutA{});      // (BLK_M, BLK_K, PIPE)
  auto [tAgA, tAsA] = tma_partition(p.tma_a, walk.rank, Layout<Int<T::kClusterSize>>{}, group_modes<0, 2>(sA),
                                    group_modes<0, 2>(gA));  // (TMA, m, t), (TMA, PIPE)
  auto [tBgB, tBsB] = tma_b_partition<T::kTileN, T::kTileK, typename T::SmemLayoutB>(p.tma_b, smem.b.data(), p.n,
                                                                                     p.width, 1);
  // A step's scales: (box, 1, box index, t) in global memory, (box, 1, PIPE) in the stages.
  auto scale_partition = [&](const auto& tma, auto box, int32_t cols, float* stages) {
    Tensor m = tma.get_tma_tensor(make_shape(cols, p.tiles));
    Tensor g = local_tile(m, make_shape(box, _1{}), make_coord(_, _));
    Tensor s = make_tensor(make_smem_ptr(stages), make_layout(make_shape(box, _1{}, Int<T::kStages>{})));
    return tma_partition(tma, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(s), group_modes<0, 2>(g));
  };
  auto [tSAg, tSAs] = scale_partition(p.tma_scale_a, Int<T::kTileM>{}, p.k, &smem.scale_a[0][0]);
  auto [tSBg, tSBs] = scale_partition(p.tma_scale_b, Int<T::kTileN>{}, p.n, &smem.scale_b[0][0]);

  constexpr uint16_t kBothCtas = (1u << T::kClusterSize) - 1;
  typename T::PipelineState write = cutlass::make_producer_start_state<typename T::Pipeline>();
  for (int64_t unit = walk.first; unit < units; unit += walk.stride) {
    const Fp8WgradUnit u = fp8_wgrad_unit(p, unit, walk.rank);
    for (int32_t step = 0; step < u.steps; ++step) {
      const int32_t t = u.first + step;
      pipeline.producer_acquire(write);  // and expects the stage's kTmaBytes (both halves of A)
      const int stage = write.index();
      auto* barrier = pipeline.producer_get_barrier(write);
      copy(p.tma_a.with(*barrier, kBothCtas), tAgA(_, u.k_tile, t), tAsA(_, stage));
      copy(p.tma_b.with(*barrier), tBgB(_, u.n_tile, t, 0), tBsB(_, stage));
      copy(p.tma_scale_a.with(*barrier), tSAg(_, u.k_tile, t), tSAs(_, stage));
      copy(p.tma_scale_b.with(*barrier), tSBg(_, u.n_tile, t), tSBs(_, stage));
      ++write;
    }
  }
  // Stay until the consumers have freed every stage.
  pipeline.producer_tail(write);
}

// total = fma(fl(P * s_row), s_col, total) per accumulator, with the step's scales of the
// tile's rows (`rows`, the thread's two: lo and hi) and columns (`cols`) in shared memory.
// In the m64nN wgmma fragment value i lies in row (i >> 1) & 1 of the thread's two rows,
// and values i, i + 1 (i even) in adjacent columns, the first even.
template <class Accum, class Coord>
__device__ __forceinline__ void fp8_wgrad_promote(Accum& total, Accum& acc, const float* rows, const float* cols,
                                                  const Coord& coord, int32_t row_lo, int32_t row_hi) {
  using namespace cute;
  warpgroup_fence_operand(acc);
  const float s_lo = rows[row_lo], s_hi = rows[row_hi];
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < size(acc); i += 2) {
    const float s_row = (i & 2) ? s_hi : s_lo;
    const float2 s_col = *reinterpret_cast<const float2*>(cols + get<1>(coord(i)));
    total(i) = __fmaf_rn(__fmul_rn(acc(i), s_row), s_col.x, total(i));
    total(i + 1) = __fmaf_rn(__fmul_rn(acc(i + 1), s_row), s_col.y, total(i + 1));
  }
}

// Warp groups 1 and 2 (see the header comment).
template <class Out, class T>
__device__ __forceinline__ void fp8_wgrad_consume(const Fp8WgradKernelParams<Out, T>& p,
                                                  typename T::SharedStorage& smem, typename T::Pipeline& pipeline,
                                                  int64_t units) {
  using namespace cute;
  const int thread = threadIdx.x - T::kProducerThreads;  // 0 .. kConsumerThreads - 1
  typename T::TiledMma mma;
  auto tensors = consumer_tensors<T>(mma, thread, smem);  // named below: lambdas capture them
  auto& tCrA = get<0>(tensors);
  auto& tCrB = get<1>(tensors);
  auto& acc = get<2>(tensors);
  auto& coord = get<3>(tensors);
  auto total = make_fragment_like(acc);
  const int32_t row_lo = get<0>(coord(0)), row_hi = get<0>(coord(2));
  const StagingPlace place = staging_place(smem, thread);
  const Fp8UnitWalk walk = fp8_unit_walk();
  typename T::PipelineState read, release;

  auto issue = [&] {
    pipeline.consumer_wait(read);
    fp8_issue_stage(mma, tCrA, tCrB, acc, read.index());
    ++read;
  };
  auto store = [&](const Fp8WgradUnit& u) {
    Out* out = p.out + static_cast<int64_t>(u.group) * p.k * p.n;
    store_accumulators_staged(out, p.n, u.k_tile * T::kTileM, p.k, u.n_tile * T::kTileN, total, coord, place);
  };

  // The unit after the current one is read one unit ahead: its first wgmma is issued
  // before the current tile is stored.
  Fp8WgradUnit next{};
  if (walk.first < units) next = fp8_wgrad_unit(p, walk.first, walk.rank);
  Fp8WgradUnit previous{};
  bool stored = true;  // whether `total` holds no unstored tile
  auto retire = [&] {
    warpgroup_wait<0>();
    const int stage = release.index();
    fp8_wgrad_promote(total, acc, smem.scale_a[stage], smem.scale_b[stage], coord, row_lo, row_hi);
    pipeline.consumer_release(release);
    ++release;
  };
  for (int64_t unit = walk.first; unit < units; unit += walk.stride) {
    const Fp8WgradUnit u = next;
    // Read the next unit and store the previous tile, under this unit's first wgmma.
    auto turn_over = [&] {
      if (unit + walk.stride < units) next = fp8_wgrad_unit(p, unit + walk.stride, walk.rank);
      if (!stored) store(previous);
      clear(total);
    };
    if (u.steps > 0) {
      issue();
      turn_over();
      retire();
      for (int32_t step = 1; step < u.steps; ++step) {
        issue();
        retire();
      }
    } else {
      turn_over();
    }
    previous = u;
    stored = false;
  }
  if (!stored) store(previous);
}

template <class Out, class T>
__global__ void __launch_bounds__(T::kThreads, 1)
    fp8_wgrad_wgmma_kernel(const __grid_constant__ Fp8WgradKernelParams<Out, T> p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ __align__(1024) char smem_raw[];  // the 128-byte swizzle needs 1024
  const int64_t units = static_cast<int64_t>(p.num_groups) * p.k_tiles * p.n_pairs;
  fp8_warp_groups<T>(
      smem_raw, [&](auto& smem, auto& pipeline) { fp8_wgrad_produce(p, smem, pipeline, units); },
      [&](auto& smem, auto& pipeline) { fp8_wgrad_consume(p, smem, pipeline, units); });
#endif
}

template <DType kOut, Fp8WgradTile kTile>
Status fp8_wgrad_wgmma_run(const Fp8WgradWgmmaLaunch& launch) {
  using Out = typename OutElement<kOut>::type;
  using T = Fp8WgradTraits<kTile>;
  const Fp8WgradParams& p = *launch.params;
  const int64_t tiles = group_col_tiles(p.m, p.num_groups);
  Fp8WgradKernelParams<Out, T> kp;
  kp.k = static_cast<int32_t>(p.k);
  kp.n = static_cast<int32_t>(p.n);
  kp.num_groups = static_cast<int32_t>(p.num_groups);
  kp.tiles = static_cast<int32_t>(tiles);
  kp.width = static_cast<int32_t>(fp8::kTile * tiles);
  const auto* lhs_t = reinterpret_cast<const cutlass::float_e4m3_t*>(p.lhs_t);
  const auto* rhs_t = reinterpret_cast<const cutlass::float_e4m3_t*>(p.rhs_t);
  kp.tma_a = make_fp8_tma_a<T>(lhs_t, kp.k, kp.width);
  kp.tma_b = make_fp8_tma_b<T>(rhs_t, kp.n, kp.width, 1);
  kp.tma_scale_a = make_fp8_tma_scales<T::kTileM>(p.lhs_scales, kp.k, kp.tiles);
  kp.tma_scale_b = make_fp8_tma_scales<T::kTileN>(p.rhs_scales, kp.n, kp.tiles);
  kp.group_tiles = launch.group_tiles;
  kp.out = static_cast<Out*>(p.out);
  kp.k_tiles = static_cast<int32_t>((p.k + T::kTileM - 1) / T::kTileM);
  const int64_t n_tiles = (p.n + T::kTileN - 1) / T::kTileN;
  kp.n_pairs = static_cast<int32_t>((n_tiles + T::kClusterSize - 1) / T::kClusterSize);
  return launch_persistent_clusters<T>(fp8_wgrad_wgmma_kernel<Out, T>, kp, p.num_groups * kp.k_tiles * kp.n_pairs,
                                       launch.stream);
}

}  // namespace detail
}  // namespace cuda
}  // namespace moe_xla

#endif  // MOE_XLA_CUDA_FP8_WGRAD_WGMMA_KERNEL_CUH_
