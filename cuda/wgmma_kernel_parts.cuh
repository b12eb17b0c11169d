// Device pieces shared by the hand-written Hopper kernels whose consumer warp groups
// multiply with wgmma (gather_gemm_kernel.cuh, gather_tgmm_kernel.cuh, whose producer warps
// gather operands with cp.async, fp8_wgmma_kernel.cuh and resident_b_gemm_kernel.cuh): the
// output element of a DType, the zero-filling 16-byte copy, the warp groups, the shared
// storage, the consumers' tensors, main loop and output stores (staged, bulk), and the
// persistent launch. Traits T name the tiles (kTileM, kTileN, SmemLayoutA/B over all
// stages, TiledMma, SharedStorage, kThreads).
#ifndef MOE_XLA_CUDA_WGMMA_KERNEL_PARTS_CUH_
#define MOE_XLA_CUDA_WGMMA_KERNEL_PARTS_CUH_

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "cute/tensor.hpp"  // first: the atoms below rely on its declarations
#include "cute/algorithm/gemm.hpp"
#include "cute/atom/copy_traits_sm90_tma.hpp"
#include "cute/atom/mma_atom.hpp"
#include "cutlass/arch/barrier.h"
#include "cutlass/cutlass.h"
#include "cutlass/pipeline/sm90_pipeline.hpp"

#include "common/grouped_gemm.h"
#include "common/status.h"

namespace moe_xla {
namespace cuda {
namespace detail {

// The C++ element type of an output DType (bf16 or f32, the kernels' output dtypes).
template <DType kOut>
struct OutElement;
template <>
struct OutElement<DType::kBF16> {
  using type = __nv_bfloat16;
};
template <>
struct OutElement<DType::kF32> {
  using type = float;
};

// Whether a producer / consumer register split (setmaxnreg) can take effect: the
// consumers' increase waits for registers the producer has freed, so both together must fit
// in what the CTA was launched with, all threads at the most __launch_bounds__(threads, 1)
// allows (65536 / threads, a multiple of 8: 168 for 384 threads). A split that only fits
// one SM's 65536 registers hangs at the consumers' increase.
constexpr bool register_split_fits(int producer_threads, int producer_registers, int consumer_threads,
                                   int consumer_registers) {
  const int threads = producer_threads + consumer_threads;
  return producer_threads * producer_registers + consumer_threads * consumer_registers <=
         threads * (65536 / threads / 8 * 8);
}

// The warp groups of a persistent kernel: warp group 0 the producer, 1 and 2 the consumers,
// and the registers per thread of each after the producer gives some up (setmaxnreg) and
// the consumers take them.
template <int kProducerRegs = 40, int kConsumerRegs = 232>
struct ProducerConsumerWarpGroups {
  static constexpr int kProducerThreads = 128;
  static constexpr int kConsumerThreads = 256;
  static constexpr int kThreads = kProducerThreads + kConsumerThreads;
  static constexpr int kProducerRegisters = kProducerRegs;
  static constexpr int kConsumerRegisters = kConsumerRegs;
  static_assert(register_split_fits(kProducerThreads, kProducerRegisters, kConsumerThreads, kConsumerRegisters),
                "setmaxnreg within the launch's registers");
};

// Shared memory of a kernel: all stages of A and B (1024-byte aligned, as the 128-byte
// swizzle needs) and the pipeline's barriers.
template <class Element, class SmemLayoutA, class SmemLayoutB, class Pipeline>
struct WgmmaSharedStorage {
  alignas(1024) cute::array_aligned<Element, cute::cosize_v<SmemLayoutA>, 1024> a;
  alignas(1024) cute::array_aligned<Element, cute::cosize_v<SmemLayoutB>, 1024> b;
  typename Pipeline::SharedStorage pipeline;
};

// The staged output store (store_accumulators_staged): each consumer warp group's buffer of
// 64 rows of 128 bytes, staging_stride<Out>() bytes apart. The padding makes the fragment's
// writes conflict-free: lane l writes sizeof(Out) * 2 bytes at row l / 4, column pair l % 4;
// for bf16 (stride 144 = 36 words) a warp's 32 words fall in banks 4 (l / 4) + l % 4 mod 32,
// for f32 (stride 160 = 40 words) a half warp's 16 word pairs in banks 8 (l / 4) + 2 (l % 4)
// and the next, all distinct.
template <class Out>
constexpr int staging_stride() {
  return 128 + 8 * static_cast<int>(sizeof(Out));
}
constexpr int kStagingBytes = 64 * staging_stride<float>();

// The bulk output store (store_accumulators_bulk): each consumer warp group's buffer of
// 64 whole rows of a kTileN-column tile, bulk_staging_stride<Out, kTileN>() bytes apart.
// 16 bytes of padding keep the rows 16-byte aligned (bulk copies need it) and, when the
// row is a multiple of 128 bytes (a 192-column bf16 tile: 400 bytes = 100 words), put
// the fragment's rows l / 4 of a warp 4 banks apart: its 32 words fall in distinct banks.
template <class Out, int kTileN>
constexpr int bulk_staging_stride() {
  return kTileN * static_cast<int>(sizeof(Out)) + 16;
}

// WgmmaSharedStorage with a staging buffer of kBytes for each of two consumer warp groups.
template <class Element, class SmemLayoutA, class SmemLayoutB, class Pipeline, int kBytes = kStagingBytes>
struct WgmmaStagedSharedStorage : WgmmaSharedStorage<Element, SmemLayoutA, SmemLayoutB, Pipeline> {
  alignas(16) char staging[2][kBytes];
};

// A consumer thread's part in the staged store: its warp group's buffer, its index in the
// group (0 .. 127) and the group's named barrier (1 or 2; 0 is __syncthreads').
struct StagingPlace {
  char* buffer;
  int thread;
  int barrier;
};
template <class Storage>
__device__ __forceinline__ StagingPlace staging_place(Storage& smem, int consumer_thread) {
  const int group = consumer_thread / 128;
  return StagingPlace{smem.staging[group], consumer_thread % 128, 1 + group};
}

// 16 bytes from global to shared memory, bypassing L1; src_bytes = 0 writes zeros and
// reads nothing.
__device__ __forceinline__ void cp_async_16_zfill(uint32_t smem_addr, const void* gmem,
                                                  uint32_t src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr), "l"(gmem),
               "r"(src_bytes)
               : "memory");
}

// Two consecutive output elements from two float32 accumulators (round to nearest even for
// bf16); `out` is aligned to the pair.
__device__ __forceinline__ void store_pair(__nv_bfloat16* out, float a, float b) {
  *reinterpret_cast<__nv_bfloat162*>(out) = __floats2bfloat162_rn(a, b);
}
__device__ __forceinline__ void store_pair(float* out, float a, float b) {
  *reinterpret_cast<float2*>(out) = make_float2(a, b);
}

// Consumer thread `thread`'s tensors (0 .. size(mma) - 1): the wgmma fragments of A and
// B over all stages (descriptors, (MMA, M|N, K, PIPE)), the accumulators of the
// kTileM x kTileN output tile and the (row, column) in the tile of each accumulator (both
// (MMA, M, N)); as a cute tuple, for a structured binding.
template <class T>
__device__ __forceinline__ auto consumer_tensors(typename T::TiledMma& mma, int thread,
                                                 typename T::SharedStorage& smem) {
  using namespace cute;
  auto thread_mma = mma.get_thread_slice(thread);
  Tensor sA = make_tensor(make_smem_ptr(smem.a.data()), typename T::SmemLayoutA{});
  Tensor sB = make_tensor(make_smem_ptr(smem.b.data()), typename T::SmemLayoutB{});
  Tensor tCrA = thread_mma.make_fragment_A(thread_mma.partition_A(sA));
  Tensor tCrB = thread_mma.make_fragment_B(thread_mma.partition_B(sB));
  const auto tile_mn = make_shape(Int<T::kTileM>{}, Int<T::kTileN>{});
  Tensor accum = partition_fragment_C(mma, tile_mn);
  Tensor coord = thread_mma.partition_C(make_identity_tensor(tile_mn));
  static_assert(size(decltype(accum){}) % 2 == 0, "accumulators come in column pairs");
  return make_tuple(tCrA, tCrB, accum, coord);
}

// The consumer warp groups' main loop: `steps` >= 1 full pipeline stages from `read` on,
// each multiplied into `accum` with wgmma (both operands from shared memory, as fragments
// of descriptors (MMA, M|N, K, PIPE)); the first wgmma overwrites accum, the others add to
// it, so accum = sum over the stages in stage order. One batch of wgmma stays in flight: a
// stage is released once the batch that read it is done, the last one after all are.
// On return `read` is past the last stage and accum is final.
template <class Pipeline, class PipelineState, class TiledMma, class FragA, class FragB, class Accum>
__device__ __forceinline__ void wgmma_stages(Pipeline& pipeline, PipelineState& read, TiledMma& mma,
                                             const FragA& tCrA, const FragB& tCrB, Accum& accum,
                                             int64_t steps) {
  using namespace cute;
  PipelineState release = read;
  mma.accumulate_ = GMMA::ScaleOut::Zero;
  for (int64_t step = 0; step < steps; ++step) {
    pipeline.consumer_wait(read);
    // The stage's gathered operand (and any part not loaded by TMA) was written by cp.async
    // (generic proxy); wgmma reads through the async proxy.
    cutlass::arch::fence_view_async_shared();
    const int stage = read.index();
    warpgroup_fence_operand(accum);
    warpgroup_arrive();
    CUTLASS_PRAGMA_UNROLL
    for (int k_block = 0; k_block < size<2>(tCrA); ++k_block) {
      gemm(mma, tCrA(_, _, k_block, stage), tCrB(_, _, k_block, stage), accum);
      mma.accumulate_ = GMMA::ScaleOut::One;
    }
    warpgroup_commit_batch();
    // One batch stays in flight; the one before it is done, so its stage is free.
    warpgroup_wait<1>();
    warpgroup_fence_operand(accum);
    if (step > 0) {
      pipeline.consumer_release(release);
      ++release;
    }
    ++read;
  }
  warpgroup_wait<0>();
  warpgroup_fence_operand(accum);
  pipeline.consumer_release(release);
}

// A pipeline of a kernel's stages in `storage` as this thread sees it: the producer warp
// group (`producer`: this thread is in it; its thread 0, the CTA's, is the leader, which
// announces `bytes` of TMA loads per stage, 0 when the producer announces them stage by
// stage) or a consumer; `producers` arrivals fill a stage and `consumers` threads read it.
// Every thread of the CTA calls it; the barriers it initialises need a CTA (or cluster)
// barrier before first use.
template <class Pipeline, class ClusterShape>
__device__ __forceinline__ Pipeline make_stage_pipeline(typename Pipeline::SharedStorage& storage, bool producer,
                                                        uint32_t bytes, uint32_t consumers, ClusterShape cluster,
                                                        uint32_t producers = 1) {
  typename Pipeline::Params params;
  params.transaction_bytes = bytes;
  params.role = producer ? Pipeline::ThreadCategory::Producer : Pipeline::ThreadCategory::Consumer;
  params.is_leader = threadIdx.x == 0;
  params.num_consumers = consumers;
  params.num_producers = producers;
  return Pipeline(storage, params, cluster);
}

// The producer's tiles of a B operand viewed as (N, K, G) (an expert's weights per g),
// loaded by `tma_b` in boxes of kBoxN x kTileK into the stages of `smem_b` (SmemLayout:
// (kBoxN, kTileK, stages)): (TMA, n, k, g) tiles of global memory and (TMA, stage) of
// shared memory, for copy(tma_b.with(barrier), tiles(_, n, k, g), stages(_, stage)).
template <int kBoxN, int kTileK, class SmemLayout, class Tma, class Element>
__device__ __forceinline__ auto tma_b_partition(const Tma& tma_b, Element* smem_b, int32_t n, int32_t k,
                                                int32_t groups) {
  using namespace cute;
  Tensor mB = tma_b.get_tma_tensor(make_shape(n, k, groups));  // (N, K, G)
  Tensor gB = local_tile(mB, Shape<_1, Int<kBoxN>, Int<kTileK>>{}, make_coord(_, _, _),
                         Step<X, _1, _1>{});  // (BOX_N, BLK_K, n, k, g)
  Tensor sB = make_tensor(make_smem_ptr(smem_b), SmemLayout{});
  return tma_partition(tma_b, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sB), group_modes<0, 2>(gB));
}

// The identity on float32: the epilogue of a product stored as it is accumulated.
struct IdentityEpilogue {
  __device__ __forceinline__ float operator()(float v) const { return v; }
};

// Stores a tile's accumulators (`coord` as from consumer_tensors) into `out`, row-major
// with n columns, through the elementwise `fn` (float32 -> float32, before the rounding to
// Out): tile element (r, c) goes to out[row0 + r][col0 + c] = fn(accum) where
// row0 + r < row_end and col0 + c < n; the others are left alone. One consumer warp group
// stores its 64 rows of the tile (rows 64 g .. 64 g + 63, g = the group's index) through
// its staging buffer (`place`, from staging_place). Stored straight, the fragment's pairs
// of 4 (bf16) or 8 (f32) bytes spread over 8 rows per warp, a 32-byte sector per store;
// staged, the group stores a slice of 128 bytes per row at a time: its fragment pairs go
// to shared memory, then each thread copies 16-byte chunks, a warp 4 whole rows per store.
// Accumulators 4 j .. 4 j + 3 lie in columns 8 j .. 8 j + 7 of the thread's columns and
// i, i + 1 in adjacent columns of one row (the wgmma accumulator layout, PTX ISA), so
// slice s holds accumulators s * kPerSlice .. (s + 1) * kPerSlice - 1; where each lands
// comes from `coord`. n % 8 == 0: a 16-byte chunk is wholly in or out.
template <class Out, class Accum, class Coord, class Fn = IdentityEpilogue>
__device__ __forceinline__ void store_accumulators_staged(Out* out, int32_t n, int32_t row0,
                                                          int32_t row_end, int32_t col0,
                                                          const Accum& accum, const Coord& coord,
                                                          const StagingPlace& place, const Fn& fn = Fn{}) {
  using namespace cute;
  constexpr int kSliceCols = 128 / static_cast<int>(sizeof(Out));
  constexpr int kPerSlice = kSliceCols / 8 * 4;
  constexpr int kChunkElems = 16 / static_cast<int>(sizeof(Out));
  constexpr int kChunksPerThread = 64 * 8 / 128;  // 64 rows of eight 16-byte chunks
  constexpr int kStride = staging_stride<Out>();
  constexpr int kAccums = size(Accum{});
  static_assert(kAccums % kPerSlice == 0, "whole slices");
  const int32_t group_row = get<0>(coord(0)) / 64 * 64;
  auto sync = [&place] { asm volatile("bar.sync %0, 128;\n" ::"r"(place.barrier) : "memory"); };
  CUTLASS_PRAGMA_UNROLL
  for (int slice = 0; slice < kAccums / kPerSlice; ++slice) {
    CUTLASS_PRAGMA_UNROLL
    for (int a = 0; a < kPerSlice; a += 2) {
      const int i = slice * kPerSlice + a;
      const int r = get<0>(coord(i)) - group_row, c = get<1>(coord(i)) - slice * kSliceCols;
      store_pair(reinterpret_cast<Out*>(place.buffer + r * kStride) + c, fn(accum(i)), fn(accum(i + 1)));
    }
    sync();  // the slice is in shared memory
    CUTLASS_PRAGMA_UNROLL
    for (int q = 0; q < kChunksPerThread; ++q) {
      const int chunk = place.thread + q * 128;
      const int r = chunk / 8, c = chunk % 8;
      const int32_t row = row0 + group_row + r, col = col0 + slice * kSliceCols + c * kChunkElems;
      if (row < row_end && col < n) {
        *reinterpret_cast<uint4*>(out + static_cast<int64_t>(row) * n + col) =
            *reinterpret_cast<const uint4*>(place.buffer + r * kStride + c * 16);
      }
    }
    sync();  // every chunk read before the next slice overwrites the buffer
  }
}

// Stores a tile's accumulators like store_accumulators_staged (identity epilogue; the same
// rows and columns written, the same values) but through a buffer of the warp group's 64
// whole rows (`place`, in a WgmmaStagedSharedStorage of 64 * bulk_staging_stride<Out,
// kTileN>() bytes per group; kTileN from the accumulators, 64 x kTileN over 128 threads):
// the fragment goes to shared memory at once, then threads 0 .. 63 of the group each start
// one bulk copy (cp.async.bulk, the TMA engine) of their row's columns col0 .. min(n,
// col0 + kTileN) - 1 to global memory, and the group moves on without waiting for the
// writes. The copies of one store are waited for (their reads of the buffer) at the start
// of the next, and all of them by bulk_store_drain before the kernel ends. n % 8 == 0 and
// 16-byte aligned `out`: each row's copy starts and ends on 16 bytes.
template <class Out, class Accum, class Coord>
__device__ __forceinline__ void store_accumulators_bulk(Out* out, int32_t n, int32_t row0, int32_t row_end,
                                                        int32_t col0, const Accum& accum, const Coord& coord,
                                                        const StagingPlace& place) {
  using namespace cute;
  constexpr int kTileN = 2 * size(Accum{});
  constexpr int kStride = bulk_staging_stride<Out, kTileN>();
  const int32_t group_row = get<0>(coord(0)) / 64 * 64;
  const bool issuer = place.thread < 64;
  auto sync = [&place] { asm volatile("bar.sync %0, 128;\n" ::"r"(place.barrier) : "memory"); };
  // The previous store's copies have read the buffer.
  if (issuer) asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
  sync();
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < size(Accum{}); i += 2) {
    const int r = get<0>(coord(i)) - group_row, c = get<1>(coord(i));
    store_pair(reinterpret_cast<Out*>(place.buffer + r * kStride) + c, accum(i), accum(i + 1));
  }
  // The buffer's writes (generic proxy) visible to the bulk copies (async proxy).
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  sync();
  if (issuer) {
    const int32_t row = row0 + group_row + place.thread;
    const int32_t cols = std::min(kTileN, n - col0);
    if (row < row_end && cols > 0) {
      const uint32_t src = static_cast<uint32_t>(__cvta_generic_to_shared(place.buffer + place.thread * kStride));
      Out* dst = out + static_cast<int64_t>(row) * n + col0;
      asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;\n" ::"l"(dst), "r"(src),
                   "r"(cols * static_cast<int32_t>(sizeof(Out)))
                   : "memory");
    }
    asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
  }
}

// Waits until the bulk copies of store_accumulators_bulk are complete (before the CTA's
// shared memory goes away).
__device__ __forceinline__ void bulk_store_drain(const StagingPlace& place) {
  if (place.thread < 64) asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
}

// Launches the persistent kernel of traits T: min(sm_count, max_units) CTAs (at least
// one) of T::kThreads threads with T::SharedStorage as dynamic shared memory.
template <class T, class Params>
Status launch_persistent(void (*kernel)(Params), const Params& kp, int64_t max_units,
                         int sm_count, cudaStream_t stream) {
  const int smem_bytes = static_cast<int>(sizeof(typename T::SharedStorage));
  MOE_XLA_RETURN_IF_CUDA_ERROR(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes));
  const int64_t grid = std::max<int64_t>(std::min<int64_t>(sm_count, max_units), 1);
  kernel<<<static_cast<unsigned>(grid), T::kThreads, smem_bytes, stream>>>(kp);
  MOE_XLA_RETURN_IF_CUDA_ERROR(cudaGetLastError());  // launch of the kernel
  return Status();
}

// Launches the persistent kernel of traits T in clusters of T::kClusterSize CTAs: as many
// clusters as can be resident at once (cudaOccupancyMaxActiveClusters; at most
// `max_units`, at least one), each CTA of T::kThreads threads with T::SharedStorage as
// dynamic shared memory.
template <class T, class Params>
Status launch_persistent_clusters(void (*kernel)(Params), const Params& kp, int64_t max_units,
                                  cudaStream_t stream) {
  const int smem_bytes = static_cast<int>(sizeof(typename T::SharedStorage));
  MOE_XLA_RETURN_IF_CUDA_ERROR(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes));
  cudaLaunchAttribute cluster;
  cluster.id = cudaLaunchAttributeClusterDimension;
  cluster.val.clusterDim.x = T::kClusterSize;
  cluster.val.clusterDim.y = 1;
  cluster.val.clusterDim.z = 1;
  cudaLaunchConfig_t config = {};
  config.blockDim = dim3(T::kThreads);
  config.dynamicSmemBytes = smem_bytes;
  config.stream = stream;
  config.attrs = &cluster;
  config.numAttrs = 1;
  config.gridDim = dim3(T::kClusterSize);
  int resident = 0;  // clusters resident at once
  MOE_XLA_RETURN_IF_CUDA_ERROR(cudaOccupancyMaxActiveClusters(&resident, kernel, &config));
  const int64_t clusters = std::max<int64_t>(std::min<int64_t>(resident, max_units), 1);
  config.gridDim = dim3(static_cast<unsigned>(clusters * T::kClusterSize));
  MOE_XLA_RETURN_IF_CUDA_ERROR(cudaLaunchKernelEx(&config, kernel, kp));
  return Status();
}

}  // namespace detail
}  // namespace cuda
}  // namespace moe_xla

#endif  // MOE_XLA_CUDA_WGMMA_KERNEL_PARTS_CUH_
