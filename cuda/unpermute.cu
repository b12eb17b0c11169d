// CUDA unpermute (combine): y[t] = sum_j weights[t, j] * y_sorted[row_map[t*k + j]]
// (weights null: every weight 1).
//
// A group of threads per token (a power of two, up to 256, sized to the row; several
// tokens per block for narrow rows). Each thread owns vector columns of the row (16, 8, 4
// or 2 bytes: the widest that the row size and both pointers allow), loops j = 0..k-1 in
// order and accumulates in float32 with explicitly rounded multiply and add (__fmul_rn,
// __fadd_rn: no FMA contraction), the same operations as the CPU kernel. row_map entries
// outside [0, R) (R rows of y_sorted) are skipped. No atomics, no shared state: deterministic.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>

#include "common/routing.h"
#include "common/status.h"
#include "cuda/device.h"
#include "cuda/routing.h"

namespace moe_xla {
namespace cuda {
namespace {

constexpr int kThreads = 256;

// Storage element of each dtype and its conversions to and from float.
template <DType D>
struct Elem;
template <>
struct Elem<DType::kF32> {
  using Bits = float;
  static __device__ __forceinline__ float load(float v) { return v; }
  static __device__ __forceinline__ float store(float v) { return v; }
};
template <>
struct Elem<DType::kBF16> {
  using Bits = uint16_t;
  static __device__ __forceinline__ float load(uint16_t b) { return __uint_as_float(uint32_t{b} << 16); }
  static __device__ __forceinline__ uint16_t store(float v) { return __bfloat16_as_ushort(__float2bfloat16_rn(v)); }
};
template <>
struct Elem<DType::kF16> {
  using Bits = uint16_t;
  static __device__ __forceinline__ float load(uint16_t b) { return __half2float(__ushort_as_half(b)); }
  static __device__ __forceinline__ uint16_t store(float v) { return __half_as_ushort(__float2half_rn(v)); }
};

template <DType D, typename V>
__global__ void combine(const V* __restrict__ y_sorted, const int32_t* __restrict__ row_map,
                        const float* __restrict__ weights, V* __restrict__ y, int64_t tokens, int k,
                        int64_t rows, int64_t row_vectors, int threads_per_row, int rows_per_block) {
  using Bits = typename Elem<D>::Bits;
  constexpr int kN = sizeof(V) / sizeof(Bits);
  static_assert(kN >= 1 && kN * sizeof(Bits) == sizeof(V), "vector of whole elements");
  const int r = threadIdx.x / threads_per_row;
  const int c0 = threadIdx.x % threads_per_row;
  if (r >= rows_per_block) return;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * rows_per_block + r;
  if (t >= tokens) return;
  const int32_t* slots = row_map + t * k;
  const float* w = weights == nullptr ? nullptr : weights + t * k;
  for (int64_t c = c0; c < row_vectors; c += threads_per_row) {
    float acc[kN];
#pragma unroll
    for (int v = 0; v < kN; ++v) acc[v] = 0.0f;
    for (int j = 0; j < k; ++j) {
      const int64_t slot = slots[j];
      if (slot < 0 || slot >= rows) continue;  // contributes 0
      const float wj = w == nullptr ? 1.0f : w[j];
      const V raw = y_sorted[slot * row_vectors + c];
      Bits e[kN];
      memcpy(e, &raw, sizeof raw);
#pragma unroll
      for (int v = 0; v < kN; ++v) acc[v] = __fadd_rn(acc[v], __fmul_rn(wj, Elem<D>::load(e[v])));
    }
    Bits out[kN];
#pragma unroll
    for (int v = 0; v < kN; ++v) out[v] = Elem<D>::store(acc[v]);
    V packed;
    memcpy(&packed, out, sizeof packed);
    y[t * row_vectors + c] = packed;
  }
}

template <DType D, typename V>
cudaError_t launch(const UnpermuteParams& p, cudaStream_t stream) {
  const int64_t row_vectors = p.hidden * static_cast<int64_t>(sizeof(typename Elem<D>::Bits)) / sizeof(V);
  int threads_per_row = 1;
  while (threads_per_row < kThreads && threads_per_row < row_vectors) threads_per_row *= 2;
  const int rows_per_block = kThreads / threads_per_row;
  const int64_t blocks = (p.tokens + rows_per_block - 1) / rows_per_block;
  if (blocks > 0x7fffffff) return cudaErrorInvalidConfiguration;
  combine<D, V><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      static_cast<const V*>(p.y_sorted), p.row_map, p.weights, static_cast<V*>(p.y), p.tokens,
      static_cast<int>(p.top_k), p.rows, row_vectors, threads_per_row, rows_per_block);
  return cudaGetLastError();
}

// Widest vector that divides the row and both base addresses.
template <DType D>
cudaError_t dispatch(const UnpermuteParams& p, cudaStream_t stream) {
  const size_t row_bytes = static_cast<size_t>(p.hidden) * sizeof(typename Elem<D>::Bits);
  const uintptr_t addresses = reinterpret_cast<uintptr_t>(p.y_sorted) | reinterpret_cast<uintptr_t>(p.y);
  auto fits = [&](size_t bytes) { return row_bytes % bytes == 0 && addresses % bytes == 0; };
  if (fits(16)) return launch<D, uint4>(p, stream);
  if (fits(8)) return launch<D, uint2>(p, stream);
  if constexpr (D == DType::kF32) {
    return launch<D, uint32_t>(p, stream);
  } else {
    if (fits(4)) return launch<D, uint32_t>(p, stream);
    return launch<D, uint16_t>(p, stream);
  }
}

}  // namespace

Status unpermute(const UnpermuteParams& p, cudaStream_t stream) {
  MOE_XLA_RETURN_IF_ERROR(require_device(DeviceSupport::kSimt, "unpermute"));
  if (p.tokens < 0 || p.hidden < 0 || p.top_k < 0 || p.rows < 0) {
    return Status::InvalidArgument("unpermute: negative dimension");
  }
  if (p.top_k > 0x7fffffff) return Status::InvalidArgument("unpermute: top_k too large");
  if (p.tokens == 0 || p.hidden == 0) return Status();
  switch (p.dtype) {
    case DType::kF32: MOE_XLA_RETURN_IF_CUDA_ERROR(dispatch<DType::kF32>(p, stream)); break;
    case DType::kBF16: MOE_XLA_RETURN_IF_CUDA_ERROR(dispatch<DType::kBF16>(p, stream)); break;
    case DType::kF16: MOE_XLA_RETURN_IF_CUDA_ERROR(dispatch<DType::kF16>(p, stream)); break;
    default: return Status::InvalidArgument("unpermute: unsupported dtype");
  }
  return Status();
}

}  // namespace cuda
}  // namespace moe_xla
