// A tile's scale and its elements' E4M3 codes on the GPU (common/fp8_blockwise.h), for
// the quantisation kernels whose threads hold 8 consecutive elements of a row (Lane) or,
// in the wgrad's column tiles (fp8_group_cols.cu), 8 consecutive elements of a column.
//
// The row and block kernels take the amax as a NaN-propagating max of |x| (one max.NaN
// per element, no classification): finite exactly when every element of the tile is.
// Then it equals the contract's amax, max m(x), except where the largest magnitude is a
// float32 subnormal: TileCoder::of makes that 0, as m(x) would. The elements of such a
// tile take fast_quotient where the scale allows it (>= 2^-80): a multiply and two fused
// multiply-adds instead of a division each, the same codes. A tile with an inf or NaN
// recomputes max m(x) and takes quantize_element, element by element, as do the rare
// scales below 2^-80. The column tiles compute max m(x) directly, with a flag that any
// element of the CTA's 128 x 128 block is not finite (then every column of the block
// codes element by element).
#ifndef MOE_XLA_CUDA_FP8_TILE_CODES_CUH_
#define MOE_XLA_CUDA_FP8_TILE_CODES_CUH_

#include <cuda_runtime.h>

#include <cstdint>

#include "common/fp8_blockwise.h"
#include "cuda/fp8_lanes.cuh"

namespace moe_xla {
namespace cuda {
namespace detail {

constexpr unsigned kFullWarp = 0xffffffffu;

// fp8::scaled_element(k, x), bitwise, in fewer instructions: mul.ftz flushes float32
// subnormal operands and results to zeros of their sign, and a result of magnitude exactly
// 2^-126 is made one too. A product the contract zeroes (at most 2^-126 after rounding with
// gradual underflow) is then zero whether the hardware flushes before or after rounding
// (either way what it keeps is at least 2^-126, and rounds to 2^-126 where gradual underflow
// does); every larger product rounds alike in both.
__device__ __forceinline__ float scaled_element_ftz(float k, float x) {
  float p;
  asm("mul.rn.ftz.f32 %0, %1, %2;" : "=f"(p) : "f"(k), "f"(x));
  return fabsf(p) == 0x1p-126f ? fp8::bits_float(fp8::float_bits(p) & 0x80000000u) : p;
}

// max(a, b), NaN if either is NaN.
__device__ __forceinline__ float max_nan(float a, float b) {
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}

// The NaN-propagating max of |x| over a thread's elements, starting from amax.
template <DType D>
__device__ __forceinline__ float lane_amax_nan(float amax, const Lane<typename Elem<D>::Bits>& v) {
#pragma unroll
  for (int j = 0; j < kLaneCols; ++j) amax = max_nan(amax, fabsf(Elem<D>::to_float(v.get(j))));
  return amax;
}

// The contract's max m(x) over a thread's elements, starting from amax.
template <DType D>
__device__ __forceinline__ float lane_amax_exact(float amax, const Lane<typename Elem<D>::Bits>& v) {
#pragma unroll
  for (int j = 0; j < kLaneCols; ++j) amax = fmaxf(amax, fp8::tile_magnitude(Elem<D>::to_float(v.get(j))));
  return amax;
}

__device__ __forceinline__ bool finite_amax(float amax) { return fp8::float_bits(amax) < fp8::kInfBits; }

// How a tile's elements are coded: its scale, fl(1 / scale), and whether fast_quotient applies.
struct TileCoder {
  float scale, inverse;
  bool fast;

  // From a finite NaN-propagating amax (finite_amax), or from max m(x) with fast off.
  __device__ __forceinline__ static TileCoder of(float amax, bool pow2, bool may_be_fast) {
    TileCoder c;
    c.scale = fp8::scale_from_amax(fp8::float_bits(amax) < fp8::kMinNormalBits ? 0.0f : amax, pow2);
    c.inverse = fp8::tile_inverse(c.scale);
    c.fast = may_be_fast && c.scale >= fp8::kFastScaleMin;
    return c;
  }

  // The codes of 8 elements of the tile: two cvt.rn.satfinite.e4m3x2 per 4 on the fast path.
  __device__ __forceinline__ Lane<uint8_t> codes(const float (&x)[kLaneCols]) const {
    Lane<uint8_t> out{};
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    if (fast) {
#pragma unroll
      for (int w = 0; w < 2; ++w) {
        float v[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) v[j] = fp8::fast_quotient(x[4 * w + j], scale, inverse);
        unsigned short lo, hi;  // (code of the higher element, code of the lower) per pair
        asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(lo) : "f"(v[1]), "f"(v[0]));
        asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(hi) : "f"(v[3]), "f"(v[2]));
        out.w[w] = uint32_t{lo} | uint32_t{hi} << 16;
      }
      return out;
    }
#endif
#pragma unroll
    for (int j = 0; j < kLaneCols; ++j) {
      out.set(j, fast ? fp8::fp8_e4m3_from_float(fp8::fast_quotient(x[j], scale, inverse))
                      : fp8::quantize_element(x[j], scale));
    }
    return out;
  }

  // The codes of a thread's 8 consecutive elements of a row tile.
  template <DType D>
  __device__ __forceinline__ Lane<uint8_t> codes(const Lane<typename Elem<D>::Bits>& v) const {
    float x[kLaneCols];
#pragma unroll
    for (int j = 0; j < kLaneCols; ++j) x[j] = Elem<D>::to_float(v.get(j));
    return codes(x);
  }
};

// The coder of a 1 x 128 row tile whose 128 elements are the v of the 16 threads of a half
// warp (lanes 0-15 or 16-31, 8 consecutive elements each). Every lane of the warp calls it.
template <DType D>
__device__ __forceinline__ TileCoder row_tile_coder(const Lane<typename Elem<D>::Bits>& v, bool pow2) {
  constexpr int kHalf = 16;
  float amax = lane_amax_nan<D>(0.0f, v);
#pragma unroll
  for (int offset = kHalf / 2; offset > 0; offset /= 2) amax = max_nan(amax, __shfl_xor_sync(kFullWarp, amax, offset));
  if (finite_amax(amax)) return TileCoder::of(amax, pow2, true);
  // The same for every lane of this half warp (it shares amax): shuffles among them alone.
  const unsigned half = 0xffffu << (threadIdx.x % 32 / kHalf * kHalf);
  float m = lane_amax_exact<D>(0.0f, v);
#pragma unroll
  for (int offset = kHalf / 2; offset > 0; offset /= 2) m = fmaxf(m, __shfl_xor_sync(half, m, offset));
  return TileCoder::of(m, pow2, false);
}

}  // namespace detail
}  // namespace cuda
}  // namespace moe_xla

#endif  // MOE_XLA_CUDA_FP8_TILE_CODES_CUH_
