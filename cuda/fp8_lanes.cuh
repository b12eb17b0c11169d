// Element access shared by the FP8 quantisation kernels (fp8_quantize.cu,
// fp8_group_cols.cu) and the elementwise row kernels (gather_rows.cu,
// activate_weighted_grad.cu): a dtype's bits and their float value, and a thread's 8 consecutive
// elements of a row held as 32-bit words, and their store.
#ifndef MOE_XLA_CUDA_FP8_LANES_CUH_
#define MOE_XLA_CUDA_FP8_LANES_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "common/grouped_gemm.h"  // DType

namespace moe_xla {
namespace cuda {
namespace detail {

constexpr int kLaneCols = 8;  // consecutive columns per thread

template <DType D>
struct Elem;
template <>
struct Elem<DType::kF32> {
  using Bits = uint32_t;
  static __device__ __forceinline__ float to_float(uint32_t b) { return __uint_as_float(b); }
  static __device__ __forceinline__ uint32_t from_float(float v) { return __float_as_uint(v); }
};
template <>
struct Elem<DType::kBF16> {
  using Bits = uint16_t;
  static __device__ __forceinline__ float to_float(uint16_t b) { return __uint_as_float(uint32_t{b} << 16); }
  static __device__ __forceinline__ uint16_t from_float(float v) {
    return __bfloat16_as_ushort(__float2bfloat16_rn(v));
  }
};
template <>
struct Elem<DType::kF16> {
  using Bits = uint16_t;
  static __device__ __forceinline__ float to_float(uint16_t b) { return __half2float(__ushort_as_half(b)); }
  static __device__ __forceinline__ uint16_t from_float(float v) { return __half_as_ushort(__float2half_rn(v)); }
};

// A thread's 8 elements of one row as one aligned access (two 16-byte loads for f32),
// held as 32-bit words: 16-bit elements stay packed two to a register until used.
template <typename T>
struct alignas(kLaneCols * sizeof(T)) Lane {
  static constexpr int kPerWord = 4 / sizeof(T);
  static constexpr int kBits = 8 * sizeof(T);
  uint32_t w[kLaneCols / kPerWord];

  __device__ __forceinline__ T get(int j) const {
    if constexpr (kPerWord == 1) return static_cast<T>(w[j]);
    return static_cast<T>(w[j / kPerWord] >> (kBits * (j % kPerWord)));
  }
  __device__ __forceinline__ void set(int j, T v) {
    if constexpr (kPerWord == 1) {
      w[j] = static_cast<uint32_t>(v);
    } else {
      const int shift = kBits * (j % kPerWord);
      const uint32_t mask = ((1u << kBits) - 1u) << shift;
      w[j / kPerWord] = (w[j / kPerWord] & ~mask) | (static_cast<uint32_t>(v) << shift);
    }
  }
};

// The Lane of 8 floats rounded to D (RNE): 16-bit types two to a conversion, the pair
// instruction (one per word) instead of a conversion and a merge per element.
template <DType D>
__device__ __forceinline__ Lane<typename Elem<D>::Bits> round_lane(const float (&v)[kLaneCols]) {
  Lane<typename Elem<D>::Bits> out;
#pragma unroll
  for (int i = 0; i < kLaneCols / Lane<typename Elem<D>::Bits>::kPerWord; ++i) {
    if constexpr (D == DType::kF32) {
      out.w[i] = __float_as_uint(v[i]);
    } else if constexpr (D == DType::kBF16) {
      const __nv_bfloat162 pair = __floats2bfloat162_rn(v[2 * i], v[2 * i + 1]);  // .x the lower half
      out.w[i] = *reinterpret_cast<const uint32_t*>(&pair);
    } else {
      const __half2 pair = __floats2half2_rn(v[2 * i], v[2 * i + 1]);
      out.w[i] = *reinterpret_cast<const uint32_t*>(&pair);
    }
  }
  return out;
}

// Whether p may be accessed in aligned units of `bytes` (a Lane's accesses need it).
inline bool aligned(const void* p, size_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

// Writes the first `valid` elements of v to dst: aligned vector stores of 8 or 16 bytes
// where kVector (all 8 inside the row, dst aligned for it), else element by element. The
// stores are the intrinsics' (st.global.v2 / v4): in the fused quantisation kernels a copy
// of the Lane, and even of a uint4, compiled to one 4-byte store per word (their PTX), and
// a warp's 16-byte-strided 4-byte stores move 4x the sectors.
template <bool kVector, typename T>
__device__ __forceinline__ void store_lane(T* dst, const Lane<T>& v, int valid) {
  if constexpr (kVector) {
    constexpr int kWords = sizeof(Lane<T>) / sizeof(uint32_t);
    if constexpr (kWords == 2) {
      __stwb(reinterpret_cast<uint2*>(dst), make_uint2(v.w[0], v.w[1]));
    } else {
#pragma unroll
      for (int i = 0; i < kWords; i += 4) {
        __stwb(reinterpret_cast<uint4*>(dst) + i / 4, make_uint4(v.w[i], v.w[i + 1], v.w[i + 2], v.w[i + 3]));
      }
    }
  } else {
    for (int j = 0; j < valid; ++j) dst[j] = v.get(j);
  }
}

}  // namespace detail
}  // namespace cuda
}  // namespace moe_xla

#endif  // MOE_XLA_CUDA_FP8_LANES_CUH_
