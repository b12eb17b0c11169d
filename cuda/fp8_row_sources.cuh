// The row sources of the CUDA quantisation kernel (cuda/fp8_quantize.cu): what it
// quantises, as a thread's 8 elements of row r from column c (valid of them inside the
// matrix, r inside it). load() reads and computes; keep() stores the rounded row of the
// fused sources (a no-op for x itself), called by the kernel once all of a thread's rows
// are loaded (fp8_quantize.cu says why). Fetch says how the kernel reads a source's rows.
#ifndef MOE_XLA_CUDA_FP8_ROW_SOURCES_CUH_
#define MOE_XLA_CUDA_FP8_ROW_SOURCES_CUH_

#include <cuda_runtime.h>

#include <cstdint>

#include "common/expert_activation.h"
#include "common/fp8_blockwise.h"
#include "cuda/fp8_lanes.cuh"

namespace moe_xla {
namespace cuda {
namespace detail {

// What a kernel quantises, as a thread's 8 elements of row r from column c (valid of them
// inside the matrix, r inside it): x itself ...
template <DType D, bool kVec>
struct Stored {
  using Bits = typename Elem<D>::Bits;
  static constexpr bool kVector = kVec;
  const Bits* __restrict__ x;
  int64_t rows, cols;

  __device__ __forceinline__ Lane<Bits> load(int64_t b, int64_t r, int64_t c, int valid) const {
    const Bits* src = x + (b * rows + r) * cols + c;
    if constexpr (kVec) return *reinterpret_cast<const Lane<Bits>*>(src);
    Lane<Bits> out{};
#pragma unroll
    for (int j = 0; j < kLaneCols; ++j) out.set(j, j < valid ? src[j] : Bits{0});
    return out;
  }
  __device__ __forceinline__ void keep(int64_t, int64_t, const Lane<Bits>&, int) const {}
};

// ... or the expert activation of h (common/expert_activation.h), rounded to D and kept
// in a (batch 1).
template <DType D, bool kVec>
struct Activated {
  using Bits = typename Elem<D>::Bits;
  static constexpr bool kVector = kVec;
  const Bits* __restrict__ h;
  Bits* __restrict__ a;
  int64_t cols;
  Activation act;

  __device__ __forceinline__ Lane<Bits> load(int64_t, int64_t r, int64_t c, int valid) const {
    const bool gated = is_gated(act);
    const Bits* gate = h + r * (gated ? 2 * cols : cols) + c;
    Lane<Bits> g{}, u{}, out{};
    if constexpr (kVector) {
      g = *reinterpret_cast<const Lane<Bits>*>(gate);
      if (gated) u = *reinterpret_cast<const Lane<Bits>*>(gate + cols);
    } else {
#pragma unroll
      for (int j = 0; j < kLaneCols; ++j) {
        if (j < valid) g.set(j, gate[j]);
        if (j < valid && gated) u.set(j, gate[cols + j]);
      }
    }
    float v[kLaneCols];  // zeros past the row's end
#pragma unroll
    for (int j = 0; j < kLaneCols; ++j) {
      v[j] = kVector || j < valid ? activate(act, Elem<D>::to_float(g.get(j)), Elem<D>::to_float(u.get(j))) : 0.0f;
    }
    return round_lane<D>(v);
  }
  __device__ __forceinline__ void keep(int64_t r, int64_t c, const Lane<Bits>& row, int valid) const {
    store_lane<kVector>(a + r * cols + c, row, valid);
  }
};

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

// ... or row src[r] of values times scale[r] (fp8::scaled_element), rounded to D and
// kept in out; a zero row where src[r] names no row of values (batch 1).
template <DType D, bool kVec>
struct Gathered {
  using Bits = typename Elem<D>::Bits;
  static constexpr bool kVector = kVec;
  const Bits* __restrict__ values;
  const int32_t* __restrict__ src;
  const float* __restrict__ scale;
  Bits* __restrict__ out;
  int64_t num_values, cols;

  // Where row r comes from: values' row s (-1: none) times k. Fetched for all of a
  // thread's rows before any of them is loaded, so that their index loads overlap.
  struct At {
    int64_t s = -1;
    float k = 0.0f;
  };
  __device__ __forceinline__ At locate(int64_t r) const {
    const int64_t s = src[r];
    return s >= 0 && s < num_values ? At{s, scale[r]} : At{-1, 0.0f};
  }

  __device__ __forceinline__ Lane<Bits> load(const At& at, int64_t c, int valid) const {
    if (at.s < 0) return Lane<Bits>{};
    const Stored<D, kVec> named{values, num_values, cols};
    const Lane<Bits> x = named.load(0, at.s, c, valid);
    float v[kLaneCols];  // zeros past the row's end
#pragma unroll
    for (int j = 0; j < kLaneCols; ++j) {
      v[j] = kVec || j < valid ? scaled_element_ftz(at.k, Elem<D>::to_float(x.get(j))) : 0.0f;
    }
    return round_lane<D>(v);
  }
  __device__ __forceinline__ void keep(int64_t r, int64_t c, const Lane<Bits>& row, int valid) const {
    store_lane<kVector>(out + r * cols + c, row, valid);
  }
};

// ... or the activation's backward from h and da (common/expert_activation.h), rounded to
// D and kept in dh (batch 1); cols are dh's (2F gated, else F). kVector also
// needs F % 8 == 0, so that no lane crosses the gate | up boundary.
template <DType D, bool kVec>
struct ActivationGrad {
  using Bits = typename Elem<D>::Bits;
  static constexpr bool kVector = kVec;
  const Bits* __restrict__ h;
  const Bits* __restrict__ da;
  Bits* __restrict__ dh;
  int64_t cols;
  Activation act;

  __device__ __forceinline__ Lane<Bits> load(int64_t, int64_t r, int64_t c, int valid) const {
    const bool gated = is_gated(act);
    const int64_t f = gated ? cols / 2 : cols;
    float v[kLaneCols] = {};  // zeros past the row's end
    if constexpr (kVector) {
      const bool up_half = gated && c >= f;
      const int64_t e = up_half ? c - f : c;
      const Lane<Bits> g = *reinterpret_cast<const Lane<Bits>*>(h + r * cols + e);
      const Lane<Bits> d = *reinterpret_cast<const Lane<Bits>*>(da + r * f + e);
      Lane<Bits> u{};
      if (gated && !up_half) u = *reinterpret_cast<const Lane<Bits>*>(h + r * cols + f + e);
#pragma unroll
      for (int j = 0; j < kLaneCols; ++j) {
        v[j] = activate_grad(act, up_half, Elem<D>::to_float(g.get(j)), Elem<D>::to_float(u.get(j)),
                             Elem<D>::to_float(d.get(j)));
      }
    } else {
#pragma unroll
      for (int j = 0; j < kLaneCols; ++j) {
        if (j >= valid) continue;
        const bool up_half = gated && c + j >= f;
        const int64_t e = up_half ? c + j - f : c + j;
        const float gate = Elem<D>::to_float(h[r * cols + e]);
        const float up = gated ? Elem<D>::to_float(h[r * cols + f + e]) : 0.0f;
        v[j] = activate_grad(act, up_half, gate, up, Elem<D>::to_float(da[r * f + e]));
      }
    }
    return round_lane<D>(v);
  }
  __device__ __forceinline__ void keep(int64_t r, int64_t c, const Lane<Bits>& row, int valid) const {
    store_lane<kVector>(dh + r * cols + c, row, valid);
  }
};

// How the kernel reads a source's rows: locate() for each of a thread's rows, then load();
// the direct sources locate nothing, the gathered rows locate their index and factor.
template <class Source>
struct Fetch {
  struct At {};
  __device__ __forceinline__ static At locate(const Source&, int64_t) { return {}; }
  __device__ __forceinline__ static auto load(const Source& src, At, int64_t b, int64_t r, int64_t c, int valid) {
    return src.load(b, r, c, valid);
  }
};
template <DType D, bool kVec>
struct Fetch<Gathered<D, kVec>> {
  using Source = Gathered<D, kVec>;
  using At = typename Source::At;
  __device__ __forceinline__ static At locate(const Source& src, int64_t r) { return src.locate(r); }
  __device__ __forceinline__ static auto load(const Source& src, const At& at, int64_t, int64_t, int64_t c,
                                              int valid) {
    return src.load(at, c, valid);
  }
};

}  // namespace detail
}  // namespace cuda
}  // namespace moe_xla

#endif  // MOE_XLA_CUDA_FP8_ROW_SOURCES_CUH_
