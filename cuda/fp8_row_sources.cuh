// The row sources of the CUDA quantisation kernel (cuda/fp8_quantize.cu): what it
// quantises, as a thread's 8 elements of row r from column c (valid of them inside the
// matrix, r inside it). x itself (Stored) is loaded straight into the elements; each fused
// source reads in two steps so that the kernel can issue the
// loads of all of a thread's rows before it computes with any of them: fetch() loads the
// row's words from memory and nothing else, value() computes the 8 elements from them
// (loaded and computed in one call, each row's arithmetic, which waits for its load, came
// before the next row's load: one row in flight per thread). keep()
// stores the rounded row of the fused sources (a no-op for x itself), called by the kernel
// once all of a thread's rows are loaded (fp8_quantize.cu says why).
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
// inside the matrix, r inside it): x itself, whose words are its elements
// (kWordsAreElements: the kernel loads them with load(), no fetch / value step) ...
template <DType D, bool kVec>
struct Stored {
  using Bits = typename Elem<D>::Bits;
  static constexpr bool kVector = kVec, kRowDots = false, kWordsAreElements = true;
  const Bits* __restrict__ x;
  int64_t rows, cols;

  // x's 8 elements of row r of batch entry b; zeros past the row's end.
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
  static constexpr bool kVector = kVec, kRowDots = false, kWordsAreElements = false;
  const Bits* __restrict__ h;
  Bits* __restrict__ a;
  int64_t cols;
  Activation act;

  struct Words {
    Lane<Bits> g, u;  // gate (or the plain input) and up; zeros past the row's end
  };
  __device__ __forceinline__ Words fetch(int64_t, int64_t r, int64_t c, int valid) const {
    const bool gated = is_gated(act);
    const Bits* gate = h + r * (gated ? 2 * cols : cols) + c;
    Words w{};
    if constexpr (kVector) {
      w.g = *reinterpret_cast<const Lane<Bits>*>(gate);
      if (gated) w.u = *reinterpret_cast<const Lane<Bits>*>(gate + cols);
    } else {
#pragma unroll
      for (int j = 0; j < kLaneCols; ++j) {
        if (j < valid) w.g.set(j, gate[j]);
        if (j < valid && gated) w.u.set(j, gate[cols + j]);
      }
    }
    return w;
  }
  __device__ __forceinline__ Lane<Bits> value(const Words& w, int64_t, int valid) const {
    float v[kLaneCols];  // zeros past the row's end
#pragma unroll
    for (int j = 0; j < kLaneCols; ++j) {
      v[j] = kVector || j < valid ? activate(act, Elem<D>::to_float(w.g.get(j)), Elem<D>::to_float(w.u.get(j))) : 0.0f;
    }
    return round_lane<D>(v);
  }
  __device__ __forceinline__ void keep(int64_t r, int64_t c, const Lane<Bits>& row, int valid) const {
    store_lane<kVector>(a + r * cols + c, row, valid);
  }
};

// ... or the routing-weighted activation's backward from h, g and omega
// (Fp8ActivateGradQuantizeParams in common/expert_activation.h), rounded to D and kept in
// dh (batch 1); cols are dh's (2F gated, else F). kVector also needs F % 8 == 0, so that
// no lane crosses the gate | up boundary. kRowDots: dot() is a thread's part of the row's
// d omega term sum g * a over its gate (or plain) columns, keep_dot() stores a tile's sum.
template <DType D, bool kVec>
struct ActivationGrad {
  using Bits = typename Elem<D>::Bits;
  static constexpr bool kVector = kVec, kRowDots = true, kWordsAreElements = false;
  const Bits* __restrict__ h;
  const Bits* __restrict__ g;
  const float* __restrict__ omega;
  Bits* __restrict__ dh;
  float* __restrict__ d_omega_tiles;
  int64_t cols;
  Activation act;

  struct Words {
    Lane<Bits> x, u, d;  // the gate (or plain input), the up and g elements; zeros past the row's end
    float w;             // omega of the row
  };
  __device__ __forceinline__ int64_t f() const { return is_gated(act) ? cols / 2 : cols; }
  // Column c + j of d h is the gate half's element e = c + j (or the up half's e = c + j - F):
  // it reads h's gate and up columns e and g's column e.
  __device__ __forceinline__ Words fetch(int64_t, int64_t r, int64_t c, int valid) const {
    const bool gated = is_gated(act);
    const int64_t f = this->f();
    Words w{};
    w.w = __ldg(omega + r);
    if constexpr (kVector) {
      const bool up_half = gated && c >= f;
      const int64_t e = up_half ? c - f : c;
      w.x = *reinterpret_cast<const Lane<Bits>*>(h + r * cols + e);
      w.d = *reinterpret_cast<const Lane<Bits>*>(g + r * f + e);
      // The up half's derivative (and d omega) read no up element.
      if (gated && !up_half) w.u = *reinterpret_cast<const Lane<Bits>*>(h + r * cols + f + e);
    } else {
#pragma unroll
      for (int j = 0; j < kLaneCols; ++j) {
        if (j >= valid) continue;
        const int64_t e = gated && c + j >= f ? c + j - f : c + j;
        w.x.set(j, h[r * cols + e]);
        if (gated) w.u.set(j, h[r * cols + f + e]);
        w.d.set(j, g[r * f + e]);
      }
    }
    return w;
  }
  __device__ __forceinline__ Lane<Bits> value(const Words& w, int64_t c, int valid) const {
    const bool gated = is_gated(act);
    const int64_t f = this->f();
    float v[kLaneCols];  // zeros past the row's end
#pragma unroll
    for (int j = 0; j < kLaneCols; ++j) {
      v[j] = kVector || j < valid
                 ? activate_grad(act, gated && c + j >= f, Elem<D>::to_float(w.x.get(j)),
                                 Elem<D>::to_float(w.u.get(j)), w.w * Elem<D>::to_float(w.d.get(j)))
                 : 0.0f;
    }
    return round_lane<D>(v);
  }
  __device__ __forceinline__ float dot(const Words& w, int64_t c, int valid) const {
    const int64_t f = this->f();
    float sum = 0.0f;
#pragma unroll
    for (int j = 0; j < kLaneCols; ++j) {
      if ((kVector || j < valid) && c + j < f) {
        const float a = activate(act, Elem<D>::to_float(w.x.get(j)), Elem<D>::to_float(w.u.get(j)));
        sum += Elem<D>::to_float(w.d.get(j)) * Elem<D>::to_float(Elem<D>::from_float(a));
      }
    }
    return sum;
  }
  __device__ __forceinline__ void keep(int64_t r, int64_t c, const Lane<Bits>& row, int valid) const {
    store_lane<kVector>(dh + r * cols + c, row, valid);
  }
  // Tile `tile` of dh holds the gate (or plain) columns of d omega's tile `tile` when there is one.
  __device__ __forceinline__ void keep_dot(int64_t r, int64_t tile, float sum) const {
    const int64_t tiles = fp8::tiles(f());
    if (tile < tiles) d_omega_tiles[r * tiles + tile] = sum;
  }
};

}  // namespace detail
}  // namespace cuda
}  // namespace moe_xla

#endif  // MOE_XLA_CUDA_FP8_ROW_SOURCES_CUH_
