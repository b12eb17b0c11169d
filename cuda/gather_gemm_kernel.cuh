// The Hopper kernel of the gather GEMM (common/gather_gemm.h): out[r] = x[src[r]] @ w[g]
// (w[g]^T with transpose_w) for the rows of the row tiles in the table of
// cuda/row_tiles.h. One source for both layouts of w: the traits, the TMA view of w
// and the wgmma's B operand are chosen by the template parameter kTransposedB; what the
// consumers store by kEpilogue (GatherEpilogue): the product, or the expert activation of
// it in float32 before its one rounding (gather_gmm_activate).
//
// One persistent CTA per SM walks the work units u = blockIdx.x, + gridDim.x, ...; unit u
// is row tile u / n_tiles of the table and column tile u % n_tiles, so the CTAs that run
// at the same time share the gathered rows of a few row tiles while they are in L2.
// Each unit is a 128 x 256 output tile, computed in 64-deep K steps through a 4-stage
// shared-memory pipeline by three warp groups:
//   - warp group 0, the producer: its 128 threads gather the A tile: each thread owns one
//     16-byte column chunk of 8 of the 128 rows, looks up their source rows once per unit
//     and, per K step, copies its 8 chunks with cp.async (zero-filled for rows past the
//     group, rows whose src is out of range and columns past K). Thread 0 also loads the B
//     tile, w[g][k0:k0+64, n0:n0+256] (its transpose w[g][n0:n0+256, k0:k0+64] with
//     kTransposedB), through a 3-D TMA descriptor of all of w, so no per-group descriptor
//     is needed and TMA zero-fills past K and N.
//     A stage is full when the TMA bytes have landed and each producer thread's cp.asyncs
//     have completed (cp.async.mbarrier.arrive.noinc: 128 arrivals + the TMA leader's).
//   - warp groups 1 and 2, the consumers: each multiplies its 64 rows of the tile by the B
//     tile with wgmma (m64n256k16, both operands from shared memory, f32 accumulators in
//     registers), keeps one batch of wgmma in flight and frees a stage when the batch that
//     read it is done; after the last K step it stores its rows (rows past the tile's group
//     and columns past N are left alone) through the epilogue, kNone and kPlain through a
//     staging buffer in shared memory, 16 bytes per thread and store
//     (store_accumulators_staged), kGated straight from the accumulators (its half-width
//     output staged measured slower: benchmarks/results/LOG.md):
//       kNone   out[r, n0 + c] = acc[c]
//       kPlain  out[r, n0 + c] = g(acc[c])                g: gelu (tanh), silu or relu
//       kGated  out[r, 128j + c] = g(acc[c]) * acc[128 + c], c < 128   g: silu or gelu (tanh)
//     For kGated the B tile of column tile j is two TMA boxes of 128 columns of w [G, K, 2F],
//     gate columns [128j, 128j + 128) and up columns [F + 128j, F + 128j + 128), so each
//     output's gate and up products land in one thread's accumulators (F % 128 == 0).
// The producer keeps loading the next unit's stages while the consumers store a tile.
#ifndef MOE_XLA_CUDA_GATHER_GEMM_KERNEL_CUH_
#define MOE_XLA_CUDA_GATHER_GEMM_KERNEL_CUH_

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

#include "common/expert_activation.h"
#include "common/gather_gemm.h"
#include "common/status.h"
#include "cuda/gather_gemm_internal.h"
#include "cuda/wgmma_kernel_parts.cuh"

namespace moe_xla {
namespace cuda {
namespace detail {

// The shared-memory layout and wgmma operand major-ness of the B tile (kTileN x kTileK of
// one stage, 128-byte swizzle), per layout of w.
template <bool kTransposedB>
struct GatherGemmBLayout;

// w [G, K, N], N contiguous: B is N-major. Its 64 x 8 atoms are tiled along K first, so
// each 64-column slice of a stage is one contiguous 64 x 64 TMA box (4 TMA loads per
// stage).
template <>
struct GatherGemmBLayout<false> {
  static constexpr cute::GMMA::Major kMajor = cute::GMMA::Major::MN;
  using Atom = cute::GMMA::Layout_MN_SW128_Atom<cutlass::bfloat16_t>;
  using Order = cute::Step<cute::_2, cute::_1, cute::_3>;
};

// w [G, N, K], K contiguous: B is K-major, 8-row x 128-byte atoms stacked along N, so a
// stage is one contiguous block of 256 rows of 128 bytes: one 64 (K) x 256 (N) TMA box.
template <>
struct GatherGemmBLayout<true> {
  static constexpr cute::GMMA::Major kMajor = cute::GMMA::Major::K;
  using Atom = cute::GMMA::Layout_K_SW128_Atom<cutlass::bfloat16_t>;
  using Order = cute::Step<cute::_1, cute::_2, cute::_3>;
};

template <bool kTransposedB>
struct GatherGemmTraits : ProducerConsumerWarpGroups<> {
  using Element = cutlass::bfloat16_t;
  using BLayout = GatherGemmBLayout<kTransposedB>;
  static constexpr int kTileM = kGatherTileM;
  static constexpr int kTileN = kGatherTileN;
  static constexpr int kTileK = 64;  // one 128-byte swizzle row of bf16
  static constexpr int kStages = 4;
  using TileShape = cute::Shape<cute::Int<kTileM>, cute::Int<kTileN>, cute::Int<kTileK>>;

  // The producer's A copy: 16-byte chunks (8 bf16), 8 per row of a K step; thread t
  // copies chunk t % 8 of rows t / 8 + 16 i, i < 8.
  static constexpr int kChunkElems = 8;
  static constexpr int kChunksPerRow = kTileK / kChunkElems;
  static constexpr int kRowsPerPass = kProducerThreads / kChunksPerRow;
  static constexpr int kPasses = kTileM / kRowsPerPass;
  static_assert(kPasses <= 32, "the producer's row mask is one 32-bit word");

  // A: K-major (x rows), 128-byte swizzle. B: as GatherGemmBLayout says.
  using SmemLayoutA = decltype(cute::tile_to_shape(
      cute::GMMA::Layout_K_SW128_Atom<Element>{},
      cute::make_shape(cute::Int<kTileM>{}, cute::Int<kTileK>{}, cute::Int<kStages>{})));
  using SmemLayoutB = decltype(cute::tile_to_shape(
      typename BLayout::Atom{},
      cute::make_shape(cute::Int<kTileN>{}, cute::Int<kTileK>{}, cute::Int<kStages>{}),
      typename BLayout::Order{}));
  // Byte offset of row m, 16-byte chunk c of one stage of SmemLayoutA: rows of 128 bytes,
  // the chunk index XORed with m mod 8 (the SW128 K-major atom of 8 rows, stacked along M).
  static constexpr uint32_t kStageBytesA = kTileM * kTileK * sizeof(Element);
  __host__ __device__ static constexpr uint32_t a_chunk_offset(int m, int c) {
    return static_cast<uint32_t>(m) * (kTileK * sizeof(Element)) +
           (static_cast<uint32_t>(c ^ (m & 7)) << 4);
  }

  // Two consumer warp groups along M, each 64 x 256.
  using TiledMma = decltype(cute::make_tiled_mma(
      cute::SM90_64x256x16_F32BF16BF16_SS<cute::GMMA::Major::K, BLayout::kMajor>{},
      cute::Layout<cute::Shape<cute::_2, cute::_1, cute::_1>>{}));
  static_assert(cute::size(TiledMma{}) == kConsumerThreads, "two consumer warp groups");

  using Pipeline = cutlass::PipelineTmaAsync<kStages>;
  using PipelineState = typename Pipeline::PipelineState;
  static constexpr uint32_t kTmaBytesB = kTileN * kTileK * sizeof(Element);

  using SharedStorage = WgmmaStagedSharedStorage<Element, SmemLayoutA, SmemLayoutB, Pipeline>;
};

// The B tile of one stage as kCount TMA boxes of kBoxN columns of w: one box of the tile's
// kTileN columns, or for kGated two of kTileN / 2, gate and up (header comment). Box b of
// stage s is entry s * kCount + b of SmemLayout, which holds the same bytes as
// SmemLayoutB: its atoms (64 columns x 8 K N-major, 8 rows x 64 K K-major) are laid out K
// first, then N, so a stage's columns are one box after the other.
template <bool kTransposedB, GatherEpilogue kEpilogue>
struct GatherBoxes {
  using T = GatherGemmTraits<kTransposedB>;
  static constexpr int kBoxN = kEpilogue == GatherEpilogue::kGated ? T::kTileN / 2 : T::kTileN;
  static constexpr int kCount = T::kTileN / kBoxN;
  using SmemLayout = decltype(cute::tile_to_shape(
      typename T::BLayout::Atom{},
      cute::make_shape(cute::Int<kBoxN>{}, cute::Int<T::kTileK>{}, cute::Int<kCount * T::kStages>{}),
      typename T::BLayout::Order{}));
  static_assert(cute::cosize_v<SmemLayout> == cute::cosize_v<typename T::SmemLayoutB>,
                "the boxes cover the stages of B");
};

// The (N, K, G) strides in elements of w [G, K, N] (N contiguous) or, with kTransposedB,
// w [G, N, K] (K contiguous).
template <bool kTransposedB>
auto gather_w_strides(int32_t n, int32_t k) {
  if constexpr (kTransposedB) {
    return cute::make_stride(int64_t{k}, cute::_1{}, int64_t{n} * k);
  } else {
    return cute::make_stride(cute::_1{}, int64_t{n}, int64_t{n} * k);
  }
}

// The TMA load of B boxes (GatherBoxes) from w viewed as (N, K, G) with the strides of its
// layout: kBoxN x kTileK into one box of SmemLayout (one TMA box of 64 K x 256 N when
// transposed, kBoxN / 64 of 64 N x 64 K otherwise).
template <bool kTransposedB, GatherEpilogue kEpilogue>
auto make_gather_tma_b(const cutlass::bfloat16_t* w, int32_t n, int32_t k, int32_t groups) {
  using T = GatherGemmTraits<kTransposedB>;
  using B = GatherBoxes<kTransposedB, kEpilogue>;
  auto tensor = cute::make_tensor(cute::make_gmem_ptr(w), cute::make_shape(n, k, groups),
                                  gather_w_strides<kTransposedB>(n, k));
  return cute::make_tma_copy(cute::SM90_TMA_LOAD{}, tensor,
                             typename B::SmemLayout{}(cute::_, cute::_, cute::Int<0>{}),
                             cute::make_shape(cute::Int<B::kBoxN>{}, cute::Int<T::kTileK>{}),
                             cute::Int<1>{});
}
template <bool kTransposedB, GatherEpilogue kEpilogue>
using GatherTmaB = decltype(make_gather_tma_b<kTransposedB, kEpilogue>(nullptr, 0, 0, 0));

template <bool kTransposedB, GatherEpilogue kEpilogue, class Out>
struct GatherGemmKernelParams {
  GatherTmaB<kTransposedB, kEpilogue> tma_b;
  const char* x;  // [tokens, k] bf16, addressed in bytes by the cp.async gather
  const int32_t* src;
  const RowTile* row_tiles;
  const RowTileCount* tile_count;
  Out* out;
  int32_t tokens, k, n, num_groups;
  int32_t n_tiles, k_tiles;
  Activation activation;  // kPlain, kGated
};

// The elementwise functions g of the activations, in float32 (common/expert_activation.h).
struct SiluEpilogue {
  __device__ __forceinline__ float operator()(float v) const { return silu(v); }
};
struct GeluEpilogue {
  __device__ __forceinline__ float operator()(float v) const { return gelu_tanh(v); }
};
struct ReluEpilogue {
  __device__ __forceinline__ float operator()(float v) const { return relu(v); }
};

// Calls store(g) with the g of `act` (of the gate for swiglu and geglu), chosen once per
// tile so that each store loop is compiled for one g; the dispatcher passes kGated only
// swiglu and geglu, kPlain only gelu, silu and relu.
template <GatherEpilogue kEpilogue, class Store>
__device__ __forceinline__ void with_activation(Activation act, const Store& store) {
  switch (act) {
    case Activation::kSwiglu:
    case Activation::kSilu:
      store(SiluEpilogue{});
      break;
    case Activation::kGeglu:
    case Activation::kGelu:
      store(GeluEpilogue{});
      break;
    case Activation::kRelu:
      if constexpr (kEpilogue == GatherEpilogue::kPlain) {
        store(ReluEpilogue{});
        break;
      }
      __trap();  // relu is not gated: the dispatcher never passes it here
    default:
      __trap();
  }
}

// The kGated store: the tile's accumulator columns c < 128 are gate products and c + 128
// the up products of the same outputs; out (f columns) gets out[r][col0 + c] =
// g(acc[c]) * acc[c + 128] for the rows r < row_end (f % 128 == 0: every column is in).
// In the m64n256 accumulator fragment a thread's value i + size/2 is the value i's column
// plus 128 in the same row (values 4v .. 4v + 3 are column block v of 8, v < 32), so the
// pairs meet in registers.
template <class Out, class Accum, class Coord, class Gate>
__device__ __forceinline__ void store_gated(Out* out, int32_t f, int32_t row0, int32_t row_end,
                                            int32_t col0, const Accum& accum, const Coord& coord,
                                            const Gate& g) {
  using namespace cute;
  constexpr int kHalf = decltype(size(accum))::value / 2;
  static_assert(kHalf == 64, "one m64n256 fragment per warp group: value i + 64 is column + 128");
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < kHalf; i += 2) {
    const int32_t row = row0 + get<0>(coord(i));
    if (row < row_end) {
      store_pair(out + static_cast<int64_t>(row) * f + col0 + get<1>(coord(i)),
                 g(accum(i)) * accum(i + kHalf), g(accum(i + 1)) * accum(i + 1 + kHalf));
    }
  }
}

// Warp group 0 (see the header comment). `units` work units, this CTA's from blockIdx.x.
template <bool kTransposedB, GatherEpilogue kEpilogue, class Out, class T = GatherGemmTraits<kTransposedB>>
__device__ __forceinline__ void gather_gemm_produce(const GatherGemmKernelParams<kTransposedB, kEpilogue, Out>& p,
                                                    typename T::SharedStorage& smem,
                                                    typename T::Pipeline& pipeline, int64_t units) {
  using namespace cute;
  const int thread = threadIdx.x;  // 0 .. kProducerThreads - 1
  const int chunk = thread % T::kChunksPerRow;
  const int first_row = thread / T::kChunksPerRow;
  const bool tma_leader = thread == 0;
  if (tma_leader) prefetch_tma_descriptor(p.tma_b.get_tma_descriptor());

  using B = GatherBoxes<kTransposedB, kEpilogue>;
  auto [tBgB, tBsB] = tma_b_partition<B::kBoxN, T::kTileK, typename B::SmemLayout>(
      p.tma_b, smem.b.data(), p.n, p.k, p.num_groups);  // (TMA, n boxes, k, g), (TMA, BOXES * PIPE)

  const uint32_t smem_a = cast_smem_ptr_to_uint(smem.a.data());
  typename T::PipelineState write = cutlass::make_producer_start_state<typename T::Pipeline>();
  for (int64_t unit = blockIdx.x; unit < units; unit += gridDim.x) {
    const RowTile tile = p.row_tiles[unit / p.n_tiles];
    const int n_tile = static_cast<int>(unit % p.n_tiles);
    // The source rows of this thread's rows of the tile; bit i of `valid` says that row i
    // is in the group and its src in [0, T).
    int32_t token[T::kPasses];
    uint32_t valid = 0;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < T::kPasses; ++i) {
      const int32_t row = tile.row_begin + first_row + i * T::kRowsPerPass;
      token[i] = 0;
      if (row < tile.row_end) {
        const int32_t s = __ldg(p.src + row);
        if (s >= 0 && s < p.tokens) {
          token[i] = s;
          valid |= 1u << i;
        }
      }
    }
    for (int k_tile = 0; k_tile < p.k_tiles; ++k_tile) {
      pipeline.producer_acquire(write);  // the leader also expects the B tile's bytes
      const int stage = write.index();
      if (tma_leader) {
        // Box b of column tile n_tile: column box n_tile, and for kGated (b = 1) the up
        // columns, F / 128 = n_tiles boxes further.
        CUTLASS_PRAGMA_UNROLL
        for (int b = 0; b < B::kCount; ++b) {
          copy(p.tma_b.with(*pipeline.producer_get_barrier(write)),
               tBgB(_, n_tile + b * p.n_tiles, k_tile, tile.group), tBsB(_, stage * B::kCount + b));
        }
      }
      const int col = k_tile * T::kTileK + chunk * T::kChunkElems;
      const bool col_in = col < p.k;  // k % 8 == 0: a chunk is wholly in or out
      const uint32_t stage_a = smem_a + stage * T::kStageBytesA;
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < T::kPasses; ++i) {
        const bool in = col_in && ((valid >> i) & 1u);
        const char* from =
            in ? p.x + (static_cast<int64_t>(token[i]) * p.k + col) * sizeof(typename T::Element)
               : p.x;
        cp_async_16_zfill(stage_a + T::a_chunk_offset(first_row + i * T::kRowsPerPass, chunk),
                          from, in ? 16u : 0u);
      }
      cutlass::arch::cpasync_barrier_arrive_noinc(pipeline.producer_get_barrier(write));
      ++write;
    }
  }
  // Stay until the consumers have freed every stage: this warp group's last copies have
  // landed and been read before it exits.
  pipeline.producer_tail(write);
}

// Stores the finished accumulators of column tile n_tile of `tile` through the epilogue
// (header comment): out [M, N] for kNone and kPlain, [M, N / 2] for kGated.
template <bool kTransposedB, GatherEpilogue kEpilogue, class Out, class Accum, class Coord,
          class T = GatherGemmTraits<kTransposedB>>
__device__ __forceinline__ void store_tile(const GatherGemmKernelParams<kTransposedB, kEpilogue, Out>& p,
                                           const RowTile& tile, int32_t n_tile, const Accum& accum,
                                           const Coord& coord, const StagingPlace& place) {
  if constexpr (kEpilogue == GatherEpilogue::kNone) {
    store_accumulators_staged(p.out, p.n, tile.row_begin, tile.row_end, n_tile * T::kTileN, accum, coord, place);
  } else if constexpr (kEpilogue == GatherEpilogue::kPlain) {
    with_activation<kEpilogue>(p.activation, [&](const auto& g) {
      store_accumulators_staged(p.out, p.n, tile.row_begin, tile.row_end, n_tile * T::kTileN, accum, coord, place,
                                g);
    });
  } else {
    with_activation<kEpilogue>(p.activation, [&](const auto& g) {
      store_gated(p.out, p.n / 2, tile.row_begin, tile.row_end, n_tile * (T::kTileN / 2), accum, coord, g);
    });
  }
}

// Warp groups 1 and 2 (see the header comment).
template <bool kTransposedB, GatherEpilogue kEpilogue, class Out, class T = GatherGemmTraits<kTransposedB>>
__device__ __forceinline__ void gather_gemm_consume(const GatherGemmKernelParams<kTransposedB, kEpilogue, Out>& p,
                                                    typename T::SharedStorage& smem,
                                                    typename T::Pipeline& pipeline, int64_t units) {
  using namespace cute;
  const int thread = threadIdx.x - T::kProducerThreads;  // 0 .. kConsumerThreads - 1
  typename T::TiledMma mma;
  auto [tCrA, tCrB, accum, coord] = consumer_tensors<T>(mma, thread, smem);
  const StagingPlace place = staging_place(smem, thread);

  typename T::PipelineState read;
  for (int64_t unit = blockIdx.x; unit < units; unit += gridDim.x) {
    const RowTile tile = p.row_tiles[unit / p.n_tiles];  // used by the stores below
    const int32_t n_tile = static_cast<int32_t>(unit % p.n_tiles);

    wgmma_stages(pipeline, read, mma, tCrA, tCrB, accum, p.k_tiles);
    store_tile(p, tile, n_tile, accum, coord, place);
  }
}

template <bool kTransposedB, GatherEpilogue kEpilogue, class Out>
__global__ void __launch_bounds__(GatherGemmTraits<kTransposedB>::kThreads, 1)
    gather_gemm_kernel(const __grid_constant__ GatherGemmKernelParams<kTransposedB, kEpilogue, Out> p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using T = GatherGemmTraits<kTransposedB>;
  extern __shared__ __align__(1024) char smem_raw[];  // the 128-byte swizzle needs 1024
  auto& smem = *reinterpret_cast<typename T::SharedStorage*>(smem_raw);
  const bool producer = cutlass::canonical_warp_group_idx() == 0;

  // Producers: the cp.async arrivals and the TMA leader.
  auto pipeline = make_stage_pipeline<typename T::Pipeline>(smem.pipeline, producer, T::kTmaBytesB,
                                                            T::kConsumerThreads,
                                                            cute::Shape<cute::_1, cute::_1, cute::_1>{},
                                                            T::kProducerThreads + 1);
  __syncthreads();  // barriers initialised before any thread uses them

  const int64_t units = p.tile_count->row_tiles * p.n_tiles;
  if (producer) {
    cutlass::arch::warpgroup_reg_dealloc<T::kProducerRegisters>();
    gather_gemm_produce(p, smem, pipeline, units);
  } else {
    cutlass::arch::warpgroup_reg_alloc<T::kConsumerRegisters>();
    gather_gemm_consume(p, smem, pipeline, units);
  }
#endif
}

template <DType kOut, GroupedLayout kLayout, GatherEpilogue kEpilogue>
Status gather_gemm_kernel_run(const GatherGemmLaunch& launch) {
  static_assert(kLayout == GroupedLayout::kGmm || kLayout == GroupedLayout::kGmmTransposed,
                "the gather GEMM computes x[src] @ w[g] or x[src] @ w[g]^T");
  constexpr bool kTransposedB = kLayout == GroupedLayout::kGmmTransposed;
  static_assert(kEpilogue == GatherEpilogue::kNone || !kTransposedB,
                "the activation epilogues take w [G, K, N]");
  constexpr bool kGated = kEpilogue == GatherEpilogue::kGated;
  using T = GatherGemmTraits<kTransposedB>;
  using Out = typename OutElement<kOut>::type;
  const GatherGemmParams& p = *launch.params;
  GatherGemmKernelParams<kTransposedB, kEpilogue, Out> kp;
  kp.tma_b = make_gather_tma_b<kTransposedB, kEpilogue>(static_cast<const typename T::Element*>(p.w),
                                                        static_cast<int32_t>(p.n), static_cast<int32_t>(p.k),
                                                        static_cast<int32_t>(p.num_groups));
  kp.x = static_cast<const char*>(p.x);
  kp.src = p.src;
  kp.row_tiles = launch.row_tiles.tiles;
  kp.tile_count = launch.row_tiles.count;
  kp.out = static_cast<Out*>(p.out);
  kp.tokens = static_cast<int32_t>(p.tokens);
  kp.k = static_cast<int32_t>(p.k);
  kp.n = static_cast<int32_t>(p.n);
  kp.num_groups = static_cast<int32_t>(p.num_groups);
  // kGated: one column tile per 128 outputs (N = 2F, F % 128 == 0, checked by the dispatcher).
  kp.n_tiles = static_cast<int32_t>(kGated ? p.n / T::kTileN : (p.n + T::kTileN - 1) / T::kTileN);
  kp.k_tiles = static_cast<int32_t>((p.k + T::kTileK - 1) / T::kTileK);
  kp.activation = p.activation;

  return launch_persistent<T>(gather_gemm_kernel<kTransposedB, kEpilogue, Out>, kp,
                              launch.row_tiles.max_tiles * kp.n_tiles, launch.sm_count, launch.stream);
}

}  // namespace detail
}  // namespace cuda
}  // namespace moe_xla

#endif  // MOE_XLA_CUDA_GATHER_GEMM_KERNEL_CUH_
