// The Hopper kernel of the gather weight gradient (common/gather_tgmm.h):
//   out[g] = sum over the rows r of group g of x_r^T (outer) dy[r]        [K, N]
// or, with transpose_out, its transpose dy[r]^T (outer) x_r               [N, K]
// as a GEMM per group: C [M, N] = A [M, rows] @ B [rows, N], contracted over the group's
// rows, with A the gathered rows of x (A[k, r] = x_r[k]) and B the rows of dy, or, for
// the transposed block, A the rows of dy and B the gathered rows of x. The kernel writes
// C in place, row-major: the transposed output costs nothing over the plain one.
//
// Work unit = (group, tile of 128 rows of C, tile of 256 columns of C): one 128 x 256
// block of out[g], summed over the group's rows 64 at a time, so each output element is
// accumulated by one CTA in row order (deterministic, no atomics, no split over CTAs).
// All units of a group run the same number of steps; the dispatcher's prep kernel lists
// the groups larger first (by size class), and unit u is group order[u / U], with the
// U = row_tiles * col_tiles units of a group in tile order (column tiles fastest, so the
// CTAs running at the same time share the group's gathered x rows and dy rows in L2).
// One persistent CTA per SM walks the units u = blockIdx.x, + gridDim.x, ... : with the
// groups in decreasing size, every CTA's k-th unit is at least as long as the next CTA's,
// so the CTAs finish within about one unit of each other.
//
// Both operands are MN-major in shared memory (the contiguous dimension of x rows and dy
// rows is the GEMM's M resp. N; bf16 wgmma takes transposed operands from shared memory),
// 128-byte swizzled, in a 4-stage pipeline between three warp groups:
//   - warp group 0, the producer: per step of 64 rows, its 128 threads copy the gathered
//     operand's tile x[src[r], c0:c0+w] (w = 128 or 256 columns: four threads per row, each
//     w / 32 16-byte chunks of 2 rows, their src entries read one step ahead) with
//     cp.async, and the dy tile
//     dy[r, c0:c0+w']: for a step of 64 rows inside the group, thread 0 loads it with
//     w' / 64 TMA boxes of 64 rows x 64 columns (dy's rows are contiguous: only x needs a
//     gather); for the group's last, partial step every thread copies its chunks with
//     cp.async. Chunks are zero-filled, reading nothing, for rows at or past the group's
//     end (for both operands: a zero row of x alone would turn an inf or NaN in the next
//     group's dy row into NaN, 0 * inf; TMA cannot stop at a group's end, hence the
//     cp.async tail), for x rows whose src lies outside [0, T) (the zero row of the
//     contract, times the row of dy as the contract says) and for columns past K or N
//     (TMA zero-fills those itself).
//     A stage is full once every producer thread's copies into it have landed
//     (cp.async.mbarrier.arrive.noinc: 128 arrivals), thread 0 has arrived, and the TMA
//     bytes it announced for the stage, if any, have landed.
//   - warp groups 1 and 2, the consumers: each multiplies its 64 rows of the block by the
//     B tile with wgmma (m64n256k16, f32 accumulators in registers), keeping one batch in
//     flight (wgmma_stages), then stores its rows of the block through a staging buffer
//     in shared memory, 16 bytes per thread and store (store_accumulators_staged; rows and
//     columns past the block's bounds are left alone). A unit of an empty group runs no
//     step and stores zeros. The next unit's description is read before the store.
// The producer keeps loading the next unit's stages while the consumers store a block.
#ifndef MOE_XLA_CUDA_GATHER_TGMM_KERNEL_CUH_
#define MOE_XLA_CUDA_GATHER_TGMM_KERNEL_CUH_

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cute/tensor.hpp"  // first: the atoms below rely on its declarations
#include "cute/algorithm/gemm.hpp"
#include "cute/arch/copy_sm90_tma.hpp"
#include "cute/atom/copy_traits_sm90_tma.hpp"
#include "cute/atom/mma_atom.hpp"
#include "cutlass/arch/barrier.h"
#include "cutlass/arch/reg_reconfig.h"
#include "cutlass/cutlass.h"
#include "cutlass/numeric_types.h"
#include "cutlass/pipeline/sm90_pipeline.hpp"

#include "common/gather_tgmm.h"
#include "common/status.h"
#include "cuda/gather_tgmm_internal.h"
#include "cuda/wgmma_kernel_parts.cuh"

namespace moe_xla {
namespace cuda {
namespace detail {

// The copies of one operand's tile, `kCols` columns of kGatherTgmmStepRows rows, in 16-byte
// chunks (8 bf16): four producer threads per row, thread t copying chunks q + 4 i (q = t % 4,
// i < kCopies) of the step's rows t / 4 + kRowsPerPass * p, p < kPasses. A warp's i-th copy
// reads 64 contiguous bytes of each of 8 rows (two whole 32-byte sectors), and a thread's
// copies of a row are i * 64 bytes apart: one address per row serves them all, and a step
// costs each thread kPasses src entries instead of one per chunk row.
template <int kCols>
struct GatherTgmmChunks {
  static constexpr int kProducerThreads = 128;
  static constexpr int kChunkBytes = 16;  // one cp.async
  static constexpr int kChunkElems = kChunkBytes / static_cast<int>(sizeof(cutlass::bfloat16_t));
  static constexpr int kThreadsPerRow = 4;
  static constexpr int kChunks = kCols / kChunkElems;
  static constexpr int kCopies = kChunks / kThreadsPerRow;
  static constexpr int kRowsPerPass = kProducerThreads / kThreadsPerRow;
  static constexpr int kPasses = kGatherTgmmStepRows / kRowsPerPass;
  static constexpr int kCopyBytes = kThreadsPerRow * kChunkBytes;  // between a thread's copies
  // Chunk q + 4 i of row r lies in atom column i / 2 at slot (q + 4 (i % 2)) ^ (r % 8) (see
  // chunk_offset): two offsets per thread and row serve every copy, and the passes, whole
  // multiples of 8 rows apart, keep the swizzle phase.
  static_assert(kChunks % 8 == 0 && kRowsPerPass % 8 == 0 && kGatherTgmmStepRows % kRowsPerPass == 0,
                "whole atoms and passes");
};

// kTransposed: the block is dy^T x[src] (A = dy, B = gathered x), else x[src]^T dy.
// The warp groups' registers (setmaxnreg): 128 * 72 + 256 * 216 or 128 * 88 + 256 * 208 =
// 64512, all the launch has (register_split_fits). The producer holds the src entries of
// two steps (2 each) and the transposed block's producer issues twice the copies (a
// 256-column x tile); the consumers (128 accumulators) compile without spills down to 208.
template <bool kTransposed>
using GatherTgmmWarpGroups = ProducerConsumerWarpGroups<kTransposed ? 88 : 72, kTransposed ? 208 : 216>;

template <bool kTransposed>
struct GatherTgmmTraits : GatherTgmmWarpGroups<kTransposed> {
  using Element = cutlass::bfloat16_t;
  static constexpr int kTileM = kGatherTgmmTileRows;  // GEMM M: rows of the output block
  static constexpr int kTileN = kGatherTgmmTileCols;  // GEMM N: columns of the output block
  static constexpr int kTileK = kGatherTgmmStepRows;  // GEMM K: rows of the group per step
  static constexpr int kStages = 4;
  static constexpr int kElementBytes = sizeof(Element);

  // Columns of x (the gathered operand) and of dy per tile.
  static constexpr int kColsX = kTransposed ? kTileN : kTileM;
  static constexpr int kColsDy = kTransposed ? kTileM : kTileN;
  using ChunksX = GatherTgmmChunks<kColsX>;
  using ChunksDy = GatherTgmmChunks<kColsDy>;

  // Both operands MN-major with the 128-byte swizzle: atoms of 64 contiguous columns by 8
  // rows, tiled along the rows first (as CUTLASS tiles MN-major operands).
  using SmemLayoutA = decltype(cute::tile_to_shape(
      cute::GMMA::Layout_MN_SW128_Atom<Element>{},
      cute::make_shape(cute::Int<kTileM>{}, cute::Int<kTileK>{}, cute::Int<kStages>{}),
      cute::Step<cute::_2, cute::_1, cute::_3>{}));
  using SmemLayoutB = decltype(cute::tile_to_shape(
      cute::GMMA::Layout_MN_SW128_Atom<Element>{},
      cute::make_shape(cute::Int<kTileN>{}, cute::Int<kTileK>{}, cute::Int<kStages>{}),
      cute::Step<cute::_2, cute::_1, cute::_3>{}));
  static constexpr uint32_t kStageBytesA = kTileM * kTileK * kElementBytes;
  static constexpr uint32_t kStageBytesB = kTileN * kTileK * kElementBytes;
  static constexpr uint32_t kStageBytesX = kTransposed ? kStageBytesB : kStageBytesA;
  static constexpr uint32_t kStageBytesDy = kTransposed ? kStageBytesA : kStageBytesB;
  // Byte offset, within one stage of either layout above, of 16-byte chunk c (columns
  // 8c .. 8c + 7) of row r: each 64-column atom column holds all kTileK rows of 128 bytes,
  // and the chunk index within the 128 bytes is XORed with r mod 8 (checked against
  // cute's layout function on the host).
  __host__ __device__ static constexpr uint32_t chunk_offset(int c, int r) {
    return static_cast<uint32_t>(c / 8) * (kTileK * 128) + static_cast<uint32_t>(r) * 128 +
           (static_cast<uint32_t>((c % 8) ^ (r % 8)) << 4);
  }

  // Two consumer warp groups along M (64 rows of the block each), each 64 x 256.
  using TiledMma = decltype(cute::make_tiled_mma(
      cute::SM90_64x256x16_F32BF16BF16_SS<cute::GMMA::Major::MN, cute::GMMA::Major::MN>{},
      cute::Layout<cute::Shape<cute::_2, cute::_1, cute::_1>>{}));
  static_assert(cute::size(TiledMma{}) == GatherTgmmWarpGroups<kTransposed>::kConsumerThreads,
                "two consumer warp groups");

  // One TMA box of dy: 64 columns (one swizzle atom wide) by the step's rows, which is one
  // contiguous 8 KiB slice of a stage of either layout; kColsDy / 64 boxes per stage.
  static constexpr int kBoxCols = 64;
  static constexpr int kBoxesDy = kColsDy / kBoxCols;
  static constexpr uint32_t kBoxBytes = kBoxCols * kTileK * kElementBytes;
  using SmemLayoutBox = decltype(cute::tile_to_shape(
      cute::GMMA::Layout_MN_SW128_Atom<Element>{},
      cute::make_shape(cute::Int<kBoxCols>{}, cute::Int<kTileK>{})));
  static_assert(kColsDy % kBoxCols == 0 && kBoxBytes * kBoxesDy == kStageBytesDy, "whole boxes");

  // Transaction bytes are announced per stage (only full steps load by TMA).
  using Pipeline = cutlass::PipelineTmaAsync<kStages>;
  using PipelineState = typename Pipeline::PipelineState;

  using SharedStorage = WgmmaStagedSharedStorage<Element, SmemLayoutA, SmemLayoutB, Pipeline>;
};

// The TMA load of boxes from dy viewed as (N, M): N contiguous; a box is kBoxCols columns
// by kTileK rows, coordinates (column, row). The same for both block layouts.
inline auto make_gather_tgmm_tma_dy(const cutlass::bfloat16_t* dy, int32_t n, int32_t m) {
  using T = GatherTgmmTraits<false>;
  auto tensor = cute::make_tensor(cute::make_gmem_ptr(dy), cute::make_shape(n, m),
                                  cute::make_stride(cute::_1{}, int64_t{n}));
  return cute::make_tma_copy(cute::SM90_TMA_LOAD{}, tensor, T::SmemLayoutBox{},
                             cute::make_shape(cute::Int<T::kBoxCols>{}, cute::Int<T::kTileK>{}),
                             cute::Int<1>{});
}
using GatherTgmmTmaDy = decltype(make_gather_tgmm_tma_dy(nullptr, 0, 0));

template <class Out>
struct GatherTgmmKernelParams {
  GatherTgmmTmaDy tma_dy;
  const char* x;   // [tokens, k] bf16, addressed in bytes by the cp.async copies
  const char* dy;  // [m, n] bf16, likewise
  const int32_t* src;
  const GatherTgmmGroupRows* groups;
  const int32_t* order;
  Out* out;  // [num_groups, k, n], or [num_groups, n, k] for the transposed blocks
  int32_t tokens, k, n;
  int32_t row_tiles, col_tiles;  // of an output block
  int64_t units;                 // num_groups * row_tiles * col_tiles
};

// What a work unit computes: block (row_tile, col_tile) of out[group], summed over the
// group's rows [start, end) in `steps` steps of kTileK rows.
struct GatherTgmmUnit {
  int32_t group, start, end, row_tile, col_tile;
  int64_t steps;
};

template <class Out>
__device__ __forceinline__ GatherTgmmUnit gather_tgmm_unit(const GatherTgmmKernelParams<Out>& p, int64_t unit) {
  const int64_t per_group = static_cast<int64_t>(p.row_tiles) * p.col_tiles;
  const int64_t inner = unit % per_group;
  GatherTgmmUnit u;
  u.group = __ldg(p.order + unit / per_group);
  const GatherTgmmGroupRows rows = p.groups[u.group];
  u.start = rows.start;
  u.end = rows.end;
  u.row_tile = static_cast<int32_t>(inner / p.col_tiles);
  u.col_tile = static_cast<int32_t>(inner % p.col_tiles);
  u.steps = (static_cast<int64_t>(rows.end) - rows.start + kGatherTgmmStepRows - 1) / kGatherTgmmStepRows;
  return u;
}

// A place in the producer's walk over this CTA's work: step `step` of unit `unit` (whose
// description is u); unit >= p.units once the walk is over.
struct GatherTgmmPosition {
  int64_t unit;
  GatherTgmmUnit u;
  int64_t step;
};

// The first step of this CTA's first unit at or after `unit` that has steps (units of
// empty groups load nothing).
template <class Out>
__device__ __forceinline__ GatherTgmmPosition gather_tgmm_seek(const GatherTgmmKernelParams<Out>& p,
                                                               int64_t unit) {
  GatherTgmmPosition pos;
  pos.step = 0;
  for (pos.unit = unit; pos.unit < p.units; pos.unit += gridDim.x) {
    pos.u = gather_tgmm_unit(p, pos.unit);
    if (pos.u.steps > 0) break;
  }
  return pos;
}

template <class Out>
__device__ __forceinline__ GatherTgmmPosition gather_tgmm_next(const GatherTgmmKernelParams<Out>& p,
                                                               GatherTgmmPosition pos) {
  if (pos.step + 1 < pos.u.steps) {
    ++pos.step;
    return pos;
  }
  return gather_tgmm_seek(p, pos.unit + gridDim.x);
}

// The src entries of a producer thread's x rows at `pos` (rows first_row + i *
// kRowsPerPass of the step), -1 past the group's end. Loads stay in flight until issued.
template <class Chunks, class Out>
__device__ __forceinline__ void gather_tgmm_src(const GatherTgmmKernelParams<Out>& p,
                                                const GatherTgmmPosition& pos, int first_row,
                                                int32_t (&src)[Chunks::kPasses]) {
  const int32_t row0 = pos.u.start + static_cast<int32_t>(pos.step) * kGatherTgmmStepRows + first_row;
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < Chunks::kPasses; ++i) {
    const int32_t row = row0 + i * Chunks::kRowsPerPass;
    src[i] = row < pos.u.end ? __ldg(p.src + row) : -1;
  }
}

// Where a producer thread's chunks of a tile go: for copy i of pass p, the shared-memory
// address to[i % 2] + (i / 2) * kAtomBytes + p * kRowsPerPass * 128 within a stage.
template <class T, class Chunks>
struct GatherTgmmTargets {
  uint32_t to[2];
  __device__ __forceinline__ GatherTgmmTargets(uint32_t base, int thread) {
    const int q = thread % Chunks::kThreadsPerRow, first_row = thread / Chunks::kThreadsPerRow;
    to[0] = base + T::chunk_offset(q, first_row);
    to[1] = base + T::chunk_offset(q + Chunks::kThreadsPerRow, first_row);
  }
};

// Copies a producer thread's chunks of one row of a tile (pass `pass`): copy i reads 16
// bytes at from + i * kCopyBytes, or nothing, zero-filling, where the row is out or the
// chunk starts at or past `cols_left` columns from `from`.
template <class T, class Chunks>
__device__ __forceinline__ void gather_tgmm_copy_row(const GatherTgmmTargets<T, Chunks>& targets,
                                                     uint32_t stage, int pass, const char* from,
                                                     bool row_in, int32_t cols_left) {
  constexpr uint32_t kAtomBytes = T::kTileK * 128;  // one 64-column atom column of a stage
  const uint32_t pass_offset = stage + pass * (Chunks::kRowsPerPass * 128);
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < Chunks::kCopies; ++i) {
    const bool in = row_in && i * Chunks::kThreadsPerRow * Chunks::kChunkElems < cols_left;
    cp_async_16_zfill(targets.to[i % 2] + pass_offset + (i / 2) * kAtomBytes, from + i * Chunks::kCopyBytes,
                      in ? 16u : 0u);
  }
}

// Warp group 0 (see the header comment). The src entries of a step are read one step
// ahead, so that their latency passes while the step before is issued and its stage
// awaited, instead of stalling the producer every step.
template <bool kTransposed, class Out>
__device__ __forceinline__ void gather_tgmm_produce(const GatherTgmmKernelParams<Out>& p,
                                                    typename GatherTgmmTraits<kTransposed>::SharedStorage& smem,
                                                    typename GatherTgmmTraits<kTransposed>::Pipeline& pipeline) {
  using T = GatherTgmmTraits<kTransposed>;
  using ChunksX = typename T::ChunksX;
  using ChunksDy = typename T::ChunksDy;
  const int thread = threadIdx.x;  // 0 .. kProducerThreads - 1
  // The four threads of a row start at columns 8 q of the tile (the same q for both tiles).
  static_assert(ChunksX::kThreadsPerRow == ChunksDy::kThreadsPerRow, "one row split for both operands");
  const int first_row = thread / ChunksX::kThreadsPerRow;
  const int32_t q_col = (thread % ChunksX::kThreadsPerRow) * ChunksX::kChunkElems;
  const uint32_t smem_a = cute::cast_smem_ptr_to_uint(smem.a.data());
  const uint32_t smem_b = cute::cast_smem_ptr_to_uint(smem.b.data());
  const GatherTgmmTargets<T, ChunksX> targets_x(kTransposed ? smem_b : smem_a, thread);
  const GatherTgmmTargets<T, ChunksDy> targets_dy(kTransposed ? smem_a : smem_b, thread);
  cutlass::bfloat16_t* const smem_dy_ptr = kTransposed ? smem.a.data() : smem.b.data();

  const bool tma_leader = thread == 0;
  const void* tma_dy = p.tma_dy.get_tma_descriptor();
  if (tma_leader) cute::prefetch_tma_descriptor(p.tma_dy.get_tma_descriptor());

  typename T::PipelineState write = cutlass::make_producer_start_state<typename T::Pipeline>();
  // Issues the copies of step `at` into the next stage, with this thread's src entries `src`.
  auto issue = [&](const GatherTgmmPosition& at, const int32_t (&src)[ChunksX::kPasses]) {
    const GatherTgmmUnit& u = at.u;
    const int32_t row0 = u.start + static_cast<int32_t>(at.step) * T::kTileK;  // < end <= m
    const int32_t dy_col0 = (kTransposed ? u.row_tile : u.col_tile) * T::kColsDy;
    const int32_t x_col0 = (kTransposed ? u.col_tile : u.row_tile) * T::kColsX;
    pipeline.producer_acquire(write);  // thread 0 arrives, announcing no bytes yet
    const int stage = write.index();
    if (row0 + T::kTileK <= u.end) {
      if (tma_leader) {
        // Announced before thread 0's cp.async arrival below, which the stage also waits
        // for: the phase cannot complete before it knows these bytes.
        pipeline.producer_expect_transaction(write, T::kStageBytesDy);
        uint64_t* barrier = pipeline.producer_get_barrier(write);
        CUTLASS_PRAGMA_UNROLL
        for (int box = 0; box < T::kBoxesDy; ++box) {
          cute::SM90_TMA_LOAD_2D::copy(
              tma_dy, barrier, static_cast<uint64_t>(cute::TMA::CacheHintSm90::EVICT_NORMAL),
              smem_dy_ptr + stage * (T::kStageBytesDy / T::kElementBytes) + box * (T::kBoxBytes / T::kElementBytes),
              dy_col0 + box * T::kBoxCols, row0);
        }
      }
    } else {
      // n % 8 == 0: a chunk is wholly inside or outside its row.
      const int32_t col = dy_col0 + q_col;
      CUTLASS_PRAGMA_UNROLL
      for (int pass = 0; pass < ChunksDy::kPasses; ++pass) {
        const int32_t row = row0 + first_row + pass * ChunksDy::kRowsPerPass;
        const bool in = row < u.end;
        const char* from = in ? p.dy + (static_cast<int64_t>(row) * p.n + col) * T::kElementBytes : p.dy;
        gather_tgmm_copy_row(targets_dy, stage * T::kStageBytesDy, pass, from, in, p.n - col);
      }
    }
    // Chunks read nothing for rows past the group's end, src outside [0, T) and columns
    // past K (k % 8 == 0: a chunk is wholly inside or outside its row).
    const int32_t col = x_col0 + q_col;
    CUTLASS_PRAGMA_UNROLL
    for (int pass = 0; pass < ChunksX::kPasses; ++pass) {
      const int32_t s = src[pass];
      const bool in = s >= 0 && s < p.tokens;
      const char* from = in ? p.x + (static_cast<int64_t>(s) * p.k + col) * T::kElementBytes : p.x;
      gather_tgmm_copy_row(targets_x, stage * T::kStageBytesX, pass, from, in, p.k - col);
    }
    cutlass::arch::cpasync_barrier_arrive_noinc(pipeline.producer_get_barrier(write));
    ++write;
  };

  // Two sets of src registers used in turn: a set loaded for the next step is not touched
  // (not even copied) until that step is issued.
  int32_t src_a[ChunksX::kPasses], src_b[ChunksX::kPasses];
  GatherTgmmPosition pos = gather_tgmm_seek(p, blockIdx.x);
  if (pos.unit < p.units) gather_tgmm_src<ChunksX>(p, pos, first_row, src_a);
  while (pos.unit < p.units) {
    GatherTgmmPosition next = gather_tgmm_next(p, pos);
    if (next.unit < p.units) gather_tgmm_src<ChunksX>(p, next, first_row, src_b);
    issue(pos, src_a);
    pos = next;
    if (pos.unit >= p.units) break;
    next = gather_tgmm_next(p, pos);
    if (next.unit < p.units) gather_tgmm_src<ChunksX>(p, next, first_row, src_a);
    issue(pos, src_b);
    pos = next;
  }
  // Stay until the consumers have freed every stage: this warp group's last copies have
  // landed and been read before it exits.
  pipeline.producer_tail(write);
}

// Warp groups 1 and 2 (see the header comment).
template <bool kTransposed, class Out>
__device__ __forceinline__ void gather_tgmm_consume(const GatherTgmmKernelParams<Out>& p,
                                                    typename GatherTgmmTraits<kTransposed>::SharedStorage& smem,
                                                    typename GatherTgmmTraits<kTransposed>::Pipeline& pipeline) {
  using namespace cute;
  using T = GatherTgmmTraits<kTransposed>;
  const int thread = threadIdx.x - T::kProducerThreads;  // 0 .. kConsumerThreads - 1
  typename T::TiledMma mma;
  auto [tCrA, tCrB, accum, coord] = consumer_tensors<T>(mma, thread, smem);
  // The output block: rows x columns, row-major.
  const int32_t rows = kTransposed ? p.n : p.k, cols = kTransposed ? p.k : p.n;

  const StagingPlace place = staging_place(smem, thread);

  typename T::PipelineState read;
  GatherTgmmUnit u;
  if (blockIdx.x < p.units) u = gather_tgmm_unit(p, blockIdx.x);
  for (int64_t unit = blockIdx.x; unit < p.units; unit += gridDim.x) {
    if (u.steps > 0) {
      wgmma_stages(pipeline, read, mma, tCrA, tCrB, accum, u.steps);
    } else {
      clear(accum);  // an empty group's block is exactly zero
    }
    // The next unit's description is read before the store, so its latency passes there.
    const GatherTgmmUnit next = unit + gridDim.x < p.units ? gather_tgmm_unit(p, unit + gridDim.x) : u;
    store_accumulators_staged(p.out + static_cast<int64_t>(u.group) * p.k * p.n, cols, u.row_tile * T::kTileM,
                              rows, u.col_tile * T::kTileN, accum, coord, place);
    u = next;
  }
}

template <bool kTransposed, class Out>
__global__ void __launch_bounds__(GatherTgmmTraits<kTransposed>::kThreads, 1)
    gather_tgmm_kernel(const __grid_constant__ GatherTgmmKernelParams<Out> p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using T = GatherTgmmTraits<kTransposed>;
  extern __shared__ __align__(1024) char smem_raw[];  // the 128-byte swizzle needs 1024
  auto& smem = *reinterpret_cast<typename T::SharedStorage*>(smem_raw);
  const bool producer = cutlass::canonical_warp_group_idx() == 0;

  // Bytes announced per stage by the producer; producers: the cp.async arrivals and the TMA
  // leader.
  auto pipeline = make_stage_pipeline<typename T::Pipeline>(smem.pipeline, producer, 0, T::kConsumerThreads,
                                                            cute::Shape<cute::_1, cute::_1, cute::_1>{},
                                                            T::kProducerThreads + 1);
  __syncthreads();  // barriers initialised before any thread uses them

  if (producer) {
    cutlass::arch::warpgroup_reg_dealloc<T::kProducerRegisters>();
    gather_tgmm_produce<kTransposed>(p, smem, pipeline);
  } else {
    cutlass::arch::warpgroup_reg_alloc<T::kConsumerRegisters>();
    gather_tgmm_consume<kTransposed>(p, smem, pipeline);
  }
#endif
}

template <bool kTransposed, class Out>
Status gather_tgmm_launch(const GatherTgmmLaunch& launch) {
  using T = GatherTgmmTraits<kTransposed>;
  const GatherTgmmParams& p = *launch.params;
  GatherTgmmKernelParams<Out> kp;
  kp.tma_dy = make_gather_tgmm_tma_dy(static_cast<const cutlass::bfloat16_t*>(p.dy),
                                      static_cast<int32_t>(p.n), static_cast<int32_t>(p.m));
  // A zero-filled copy reads nothing but still names an address: x's base, or dy's when
  // there are no tokens (x may then be null, and every x row is zero).
  kp.x = static_cast<const char*>(p.tokens > 0 ? p.x : p.dy);
  kp.dy = static_cast<const char*>(p.dy);
  kp.src = p.src;
  kp.groups = launch.groups;
  kp.order = launch.order;
  kp.out = static_cast<Out*>(p.out);
  kp.tokens = static_cast<int32_t>(p.tokens);
  kp.k = static_cast<int32_t>(p.k);
  kp.n = static_cast<int32_t>(p.n);
  const int64_t rows = kTransposed ? p.n : p.k, cols = kTransposed ? p.k : p.n;
  kp.row_tiles = static_cast<int32_t>((rows + T::kTileM - 1) / T::kTileM);
  kp.col_tiles = static_cast<int32_t>((cols + T::kTileN - 1) / T::kTileN);
  kp.units = p.num_groups * kp.row_tiles * kp.col_tiles;

  return launch_persistent<T>(gather_tgmm_kernel<kTransposed, Out>, kp, kp.units, launch.sm_count,
                              launch.stream);
}

template <DType kOut>
Status gather_tgmm_kernel_run(const GatherTgmmLaunch& launch) {
  using Out = typename OutElement<kOut>::type;
  return launch.params->transpose_out ? gather_tgmm_launch<true, Out>(launch)
                                      : gather_tgmm_launch<false, Out>(launch);
}

}  // namespace detail
}  // namespace cuda
}  // namespace moe_xla

#endif  // MOE_XLA_CUDA_GATHER_TGMM_KERNEL_CUH_
