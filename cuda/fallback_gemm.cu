// SIMT fallback for the grouped products: every layout, f32/bf16/f16 inputs, f32/bf16/f16
// outputs, any shape and alignment. Shared-memory tiled (64x64 output tiles, 16-deep
// k-steps, 4x4 outputs per thread, register-staged prefetch of the next k-step), f32
// accumulation.
//
// gmm:  one block per (64-row, 64-column) output tile. It finds the first group that
//       intersects its rows by binary search on the device offsets and accumulates, group
//       by group, the rows of that group only (other rows load as zero). Rows that belong
//       to no group accumulate nothing and are written as zero.
// tgmm: one block per (64 x 64 tile of out[g], g); it loops over the rows of group g.
//       Empty groups write zero blocks.
// All global loads are bounds-checked, so no group_sizes data can make them go out of range
// (the offsets are clamped to [0, M] by the scan kernel).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "common/grouped_gemm.h"
#include "common/status.h"
#include "cuda/grouped_gemm_internal.h"

namespace moe_xla {
namespace cuda {
namespace detail {
namespace {

constexpr int kBM = 64;    // output tile rows (gmm: rows of M; tgmm: rows of K)
constexpr int kBN = 64;    // output tile columns (N)
constexpr int kBK = 16;    // reduction step (gmm: K; tgmm: rows of the group)
constexpr int kPad = 4;    // keeps float4 alignment, spreads the transposed stores over banks
constexpr int kThreads = 256;
static_assert(kBM * kBK == 4 * kThreads && kBN * kBK == 4 * kThreads,
              "each thread stages 4 elements of each operand tile");

template <typename T>
__device__ __forceinline__ float to_f32(T v);
template <>
__device__ __forceinline__ float to_f32<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ float to_f32<__nv_bfloat16>(__nv_bfloat16 v) {
  return __bfloat162float(v);
}
template <>
__device__ __forceinline__ float to_f32<__half>(__half v) {
  return __half2float(v);
}

template <typename T>
__device__ __forceinline__ T from_f32(float v);
template <>
__device__ __forceinline__ float from_f32<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}
template <>
__device__ __forceinline__ __half from_f32<__half>(float v) {
  return __float2half_rn(v);
}

struct __align__(16) TileSmem {
  float a[kBK][kBM + kPad];  // a[kk][i]: operand A, i along the output rows
  float b[kBK][kBN + kPad];  // b[kk][j]: operand B, j along the output columns
};

// Which index of a (64 x 16) operand tile is contiguous in global memory decides how the
// 256 threads split it: 4 consecutive elements per thread along the contiguous index.
//   kWideContig: thread t holds (kk = t / 16, w = (t % 16) * 4 + e)
//   kDepthContig: thread t holds (w = t / 4, kk = (t % 4) * 4 + e)
enum class Contig { kWide, kDepth };

template <Contig kC>
__device__ __forceinline__ void staged_coords(int tid, int e, int& w, int& kk) {
  if constexpr (kC == Contig::kWide) {
    kk = tid / 16;
    w = (tid % 16) * 4 + e;
  } else {
    w = tid / 4;
    kk = (tid % 4) * 4 + e;
  }
}

// Multiply-accumulate one staged k-step from shared memory.
__device__ __forceinline__ void mma_step(const TileSmem& s, int tx, int ty, float (&acc)[4][4]) {
#pragma unroll
  for (int kk = 0; kk < kBK; ++kk) {
    const float4 a = *reinterpret_cast<const float4*>(&s.a[kk][ty * 4]);
    const float4 b = *reinterpret_cast<const float4*>(&s.b[kk][tx * 4]);
    const float av[4] = {a.x, a.y, a.z, a.w};
    const float bv[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
#pragma unroll
      for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(av[i], bv[j], acc[i][j]);
    }
  }
}

template <Contig kCA, Contig kCB>
__device__ __forceinline__ void store_staged(TileSmem& s, int tid, const float (&ra)[4],
                                             const float (&rb)[4]) {
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    int w, kk;
    staged_coords<kCA>(tid, e, w, kk);
    s.a[kk][w] = ra[e];
    staged_coords<kCB>(tid, e, w, kk);
    s.b[kk][w] = rb[e];
  }
}

// Generic pipelined reduction: `load(k0, ra, rb)` fills the registers for the k-step
// starting at k0 (zero outside the valid range); depth is the reduction length.
template <Contig kCA, Contig kCB, typename Load>
__device__ __forceinline__ void reduce_tile(TileSmem& s, int64_t depth_begin, int64_t depth_end,
                                            Load load, float (&acc)[4][4]) {
  const int tid = threadIdx.x;
  const int tx = tid % 16, ty = tid / 16;
  float ra[4], rb[4];
  load(depth_begin, ra, rb);
  for (int64_t k0 = depth_begin; k0 < depth_end; k0 += kBK) {
    store_staged<kCA, kCB>(s, tid, ra, rb);
    __syncthreads();
    if (k0 + kBK < depth_end) load(k0 + kBK, ra, rb);
    mma_step(s, tx, ty, acc);
    __syncthreads();
  }
}

template <typename TOut>
__device__ __forceinline__ void write_tile(TOut* out, int64_t ld, int64_t rows, int64_t cols,
                                           int64_t row0, int64_t col0, const float (&acc)[4][4]) {
  const int tid = threadIdx.x;
  const int tx = tid % 16, ty = tid / 16;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int64_t r = row0 + ty * 4 + i;
    if (r >= rows) continue;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int64_t c = col0 + tx * 4 + j;
      if (c < cols) out[r * ld + c] = from_f32<TOut>(acc[i][j]);
    }
  }
}

// gmm / gmm with transposed rhs.
template <GroupedLayout kLayout, typename TIn, typename TOut>
__global__ void __launch_bounds__(kThreads)
    fallback_gmm_kernel(const TIn* __restrict__ lhs, const TIn* __restrict__ rhs,
                        TOut* __restrict__ out, const int64_t* __restrict__ offsets,
                        int64_t num_groups, int64_t m, int64_t k, int64_t n, int64_t row_tiles,
                        int64_t col_tiles) {
  constexpr Contig kCA = Contig::kDepth;  // lhs rows are K-contiguous
  constexpr Contig kCB = kLayout == GroupedLayout::kGmm ? Contig::kWide : Contig::kDepth;
  __shared__ TileSmem smem;
  const int tid = threadIdx.x;
  const int64_t covered = offsets[num_groups];  // rows that belong to some group

  for (int64_t rt = blockIdx.x; rt < row_tiles; rt += gridDim.x) {
    for (int64_t ct = blockIdx.y; ct < col_tiles; ct += gridDim.y) {
      const int64_t row0 = rt * kBM, col0 = ct * kBN;
      const int64_t row_hi = row0 + kBM < m ? row0 + kBM : m;
      float acc[4][4] = {};
      if (row0 < covered) {
        // First group whose end lies past row0 (exists since offsets[G] = covered > row0).
        int64_t lo = 0, hi = num_groups - 1;
        while (lo < hi) {
          const int64_t mid = lo + (hi - lo) / 2;
          if (offsets[mid + 1] > row0) {
            hi = mid;
          } else {
            lo = mid + 1;
          }
        }
        for (int64_t g = lo; g < num_groups; ++g) {
          const int64_t gs = offsets[g], ge = offsets[g + 1];
          if (gs >= row_hi || gs >= covered) break;
          const int64_t r_begin = gs > row0 ? gs : row0;
          const int64_t r_end = ge < row_hi ? ge : row_hi;
          if (r_begin >= r_end) continue;  // empty group
          const TIn* b = rhs + g * k * n;
          auto load = [&](int64_t k0, float (&ra)[4], float (&rb)[4]) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              int w, kk;
              staged_coords<kCA>(tid, e, w, kk);
              const int64_t r = row0 + w, kc = k0 + kk;
              ra[e] = (r >= r_begin && r < r_end && kc < k) ? to_f32(lhs[r * k + kc]) : 0.f;
              staged_coords<kCB>(tid, e, w, kk);
              const int64_t c = col0 + w, kb = k0 + kk;
              if constexpr (kLayout == GroupedLayout::kGmm) {
                rb[e] = (kb < k && c < n) ? to_f32(b[kb * n + c]) : 0.f;
              } else {
                rb[e] = (kb < k && c < n) ? to_f32(b[c * k + kb]) : 0.f;
              }
            }
          };
          reduce_tile<kCA, kCB>(smem, 0, k, load, acc);
        }
      }
      write_tile(out, n, m, n, row0, col0, acc);
    }
  }
}

// tgmm: out[g] = lhs[rows g]^T @ rhs[rows g].
template <typename TIn, typename TOut>
__global__ void __launch_bounds__(kThreads)
    fallback_tgmm_kernel(const TIn* __restrict__ lhs, const TIn* __restrict__ rhs,
                         TOut* __restrict__ out, const int64_t* __restrict__ offsets,
                         int64_t num_groups, int64_t k, int64_t n, int64_t k_tiles,
                         int64_t n_tiles) {
  constexpr Contig kCA = Contig::kWide;  // lhs rows are K-contiguous: contiguous along i
  constexpr Contig kCB = Contig::kWide;  // rhs rows are N-contiguous: contiguous along j
  __shared__ TileSmem smem;
  const int tid = threadIdx.x;
  const int64_t tiles = k_tiles * n_tiles;
  for (int64_t g = blockIdx.y; g < num_groups; g += gridDim.y) {
    const int64_t gs = offsets[g], ge = offsets[g + 1];
    for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
      const int64_t i0 = (t / n_tiles) * kBM, j0 = (t % n_tiles) * kBN;
      float acc[4][4] = {};
      auto load = [&](int64_t r0, float (&ra)[4], float (&rb)[4]) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          int w, kk;
          staged_coords<kCA>(tid, e, w, kk);
          const int64_t ra_row = r0 + kk, i = i0 + w;
          ra[e] = (ra_row < ge && i < k) ? to_f32(lhs[ra_row * k + i]) : 0.f;
          staged_coords<kCB>(tid, e, w, kk);
          const int64_t rb_row = r0 + kk, j = j0 + w;
          rb[e] = (rb_row < ge && j < n) ? to_f32(rhs[rb_row * n + j]) : 0.f;
        }
      };
      reduce_tile<kCA, kCB>(smem, gs, ge, load, acc);
      write_tile(out + g * k * n, n, k, n, i0, j0, acc);
    }
  }
}

template <typename T>
struct TypeTag {
  using type = T;
};

template <typename F>
void dispatch_dtype(DType d, F&& f) {
  switch (d) {
    case DType::kF32:
      f(TypeTag<float>{});
      break;
    case DType::kBF16:
      f(TypeTag<__nv_bfloat16>{});
      break;
    case DType::kF16:
      f(TypeTag<__half>{});
      break;
  }
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace

// `p` was validated by the dispatcher (grouped_gemm.cu), its only caller.
Status fallback_grouped_run(const GroupedGemmParams& p, const int64_t* offsets,
                            cudaStream_t stream) {
  const dim3 block(kThreads);
  dispatch_dtype(p.in_dtype, [&](auto in_tag) {
    using TIn = typename decltype(in_tag)::type;
    dispatch_dtype(p.out_dtype, [&](auto out_tag) {
      using TOut = typename decltype(out_tag)::type;
      const TIn* lhs = static_cast<const TIn*>(p.lhs);
      const TIn* rhs = static_cast<const TIn*>(p.rhs);
      TOut* out = static_cast<TOut*>(p.out);
      if (p.layout == GroupedLayout::kTgmm) {
        const int64_t k_tiles = ceil_div(p.k, kBM), n_tiles = ceil_div(p.n, kBN);
        const dim3 grid(static_cast<unsigned>(std::min<int64_t>(k_tiles * n_tiles, INT32_MAX)),
                        static_cast<unsigned>(std::min<int64_t>(p.num_groups, 65535)));
        fallback_tgmm_kernel<TIn, TOut><<<grid, block, 0, stream>>>(
            lhs, rhs, out, offsets, p.num_groups, p.k, p.n, k_tiles, n_tiles);
      } else {
        const int64_t row_tiles = ceil_div(p.m, kBM), col_tiles = ceil_div(p.n, kBN);
        const dim3 grid(static_cast<unsigned>(std::min<int64_t>(row_tiles, INT32_MAX)),
                        static_cast<unsigned>(std::min<int64_t>(col_tiles, 65535)));
        if (p.layout == GroupedLayout::kGmm) {
          fallback_gmm_kernel<GroupedLayout::kGmm, TIn, TOut><<<grid, block, 0, stream>>>(
              lhs, rhs, out, offsets, p.num_groups, p.m, p.k, p.n, row_tiles, col_tiles);
        } else {
          fallback_gmm_kernel<GroupedLayout::kGmmTransposed, TIn, TOut>
              <<<grid, block, 0, stream>>>(lhs, rhs, out, offsets, p.num_groups, p.m, p.k, p.n,
                                           row_tiles, col_tiles);
        }
      }
    });
  });
  MOE_XLA_RETURN_IF_CUDA_ERROR(cudaGetLastError());  // launch of the SIMT kernel
  return Status();
}

}  // namespace detail
}  // namespace cuda
}  // namespace moe_xla
