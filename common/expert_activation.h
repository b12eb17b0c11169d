// The expert activations of the MoE layer in float32, shared by the CPU and CUDA kernels
// that fuse them with the FP8 row quantisation or with the routing weight's backward
// (moe_xla/activations.py states the same functions in jnp):
//   gated, on h [rows, 2F] = gate | up:  a = g(gate) * up   swiglu: g = silu, geglu: g = gelu
//   plain, on h [rows, F]:               a = g(h)           gelu, silu, relu
//   silu(x) = x / (1 + exp(-x));  gelu(x) = x / 2 * (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
//   (the tanh approximation); relu(x) = max(x, 0), NaN kept.
// Their derivatives, for the fused backward (d h = d/dh of sum(act(h) * da), da [rows, F]):
//   gated:  d gate = da * up * g'(gate),  d up = da * g(gate)
//   plain:  d h = da * g'(h)
//   silu'(x) = s (1 + x (1 - s)), s = 1 / (1 + exp(-x));
//   gelu'(x) = (1 + t) / 2 + x / 2 (1 - t^2) sqrt(2/pi) (1 + 3 * 0.044715 x^2), t as in gelu;
//   relu'(x) = 1 if x > 0 else 0 (NaN gives 0 and d h = 0, as jax.nn.relu's rule selects).
// exp and tanh are the platform's float32 functions (within a few ulp of each other and of
// XLA's), so the activation is not bitwise the same across platforms; what the fused kernels
// guarantee bitwise is that q and scales quantise the a (or d h) they return, rounded to its
// dtype.
#ifndef MOE_XLA_COMMON_EXPERT_ACTIVATION_H_
#define MOE_XLA_COMMON_EXPERT_ACTIVATION_H_

#include <cmath>
#include <cstdint>

#include "common/grouped_gemm.h"  // DType, MOE_XLA_HOST_DEVICE

namespace moe_xla {

// The attribute value of each activation (the order of moe_xla.activations.ACTIVATIONS).
enum class Activation : int32_t { kSwiglu = 0, kGeglu = 1, kGelu = 2, kSilu = 3, kRelu = 4 };
constexpr int32_t kNumActivations = 5;

MOE_XLA_HOST_DEVICE inline bool is_gated(Activation act) {
  return act == Activation::kSwiglu || act == Activation::kGeglu;
}

MOE_XLA_HOST_DEVICE inline float silu(float x) { return x / (1.0f + expf(-x)); }

MOE_XLA_HOST_DEVICE inline float gelu_tanh(float x) {
  constexpr float kSqrt2OverPi = 0.7978845608028654f;
  return 0.5f * x * (1.0f + tanhf(kSqrt2OverPi * (x + 0.044715f * x * x * x)));
}

MOE_XLA_HOST_DEVICE inline float relu(float x) { return x > 0.0f || x != x ? x : 0.0f; }

// a for one element: gate and up for the gated activations, gate alone (h) otherwise.
MOE_XLA_HOST_DEVICE inline float activate(Activation act, float gate, float up) {
  switch (act) {
    case Activation::kSwiglu: return silu(gate) * up;
    case Activation::kGeglu: return gelu_tanh(gate) * up;
    case Activation::kGelu: return gelu_tanh(gate);
    case Activation::kSilu: return silu(gate);
    case Activation::kRelu: return relu(gate);
  }
  return gate;
}

MOE_XLA_HOST_DEVICE inline float silu_grad(float x) {
  const float s = 1.0f / (1.0f + expf(-x));
  return s * (1.0f + x * (1.0f - s));
}

MOE_XLA_HOST_DEVICE inline float gelu_tanh_grad(float x) {
  constexpr float kSqrt2OverPi = 0.7978845608028654f;
  const float t = tanhf(kSqrt2OverPi * (x + 0.044715f * x * x * x));
  return 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * kSqrt2OverPi * (1.0f + 3.0f * 0.044715f * x * x);
}

// Both halves of d h at one column of a gated activation, g and g' of the gate computed
// together, sharing their exp or tanh (the CUDA backwards that write both halves from one
// read of gate and up): d gate = da * up * g'(gate), d up = da * g(gate); and a = g(gate) *
// up, the forward's activation before rounding (their d omega term). g is within an ulp of
// silu / gelu_tanh: gate * s rounds twice where silu divides once.
struct GatedGrad {
  float d_gate, d_up, a;
};
MOE_XLA_HOST_DEVICE inline GatedGrad gated_grad(Activation act, float gate, float up, float da) {
  float g, dg;
  if (act == Activation::kSwiglu) {
#if defined(__CUDA_ARCH__)
    const float s = __frcp_rn(1.0f + expf(-gate));  // the correctly rounded 1 / (1 + e^-gate)
#else
    const float s = 1.0f / (1.0f + expf(-gate));
#endif
    g = gate * s;
    dg = s * (1.0f + gate * (1.0f - s));
  } else {
    constexpr float kSqrt2OverPi = 0.7978845608028654f;
    const float t = tanhf(kSqrt2OverPi * (gate + 0.044715f * gate * gate * gate));
    g = 0.5f * gate * (1.0f + t);
    dg = 0.5f * (1.0f + t) + 0.5f * gate * (1.0f - t * t) * kSqrt2OverPi * (1.0f + 3.0f * 0.044715f * gate * gate);
  }
  return {da * up * dg, da * g, g * up};
}

// d h for one element: of the up half (gated only) or else of the gate / h element, with
// the row's gate and up at that column (up unused by the plain activations) and da.
MOE_XLA_HOST_DEVICE inline float activate_grad(Activation act, bool up_half, float gate, float up, float da) {
  switch (act) {
    case Activation::kSwiglu: return up_half ? da * silu(gate) : da * up * silu_grad(gate);
    case Activation::kGeglu: return up_half ? da * gelu_tanh(gate) : da * up * gelu_tanh_grad(gate);
    case Activation::kGelu: return da * gelu_tanh_grad(gate);
    case Activation::kSilu: return da * silu_grad(gate);
    case Activation::kRelu: return gate > 0.0f ? da : 0.0f;
  }
  return da;
}

// The fused activation and 1 x 128 row quantisation of the FP8 expert MLP:
//   h      [rows, 2 cols] (gated, gate | up) or [rows, cols], of dtype
//   a      [rows, cols] of dtype: activate(h) in float32, rounded to dtype (RNE)
//   q, scales  quantize_fp8_rows(a) (common/fp8_blockwise.h): [rows, cols], [rows, ceil(cols / 128)]
struct Fp8ActivateQuantizeParams {
  const void* h;
  DType dtype;  // of h and a
  void* a;
  uint8_t* q;
  float* scales;
  int64_t rows;
  int64_t cols;
  Activation activation;
  bool pow2_scale;
};

// Its backward, routing-weighted, fused with the 1 x 128 row quantisation of d h (what the
// FP8 dgrad of the first product reads): with g the cotangent of omega[r] * act(h[r]),
//   h      [rows, 2F] (gated) or [rows, F], of dtype; g [rows, F] of dtype; omega [rows] float32
//   dh     [rows, cols] of dtype, cols = 2F or F: activate_grad with da = omega[r] * g[r]
//          formed in float32 (not rounded), rounded (RNE)
//   q, scales  quantize_fp8_rows(dh): [rows, cols], [rows, ceil(cols / 128)] (tiles run
//              across the gate | up boundary when F is not a multiple of 128)
//   d_omega_tiles [rows, ceil(F / 128)] float32: tile t holds sum_f g[r, f] * a[r, f] over
//          f in [128 t, 128 t + 128) and below F, a = activate(h) rounded to dtype (the a
//          the forward multiplied); products and sums in float32, order unspecified. Their
//          sum over t is d/d omega[r] of sum_r omega[r] <act(h[r]), g[r]>.
struct Fp8ActivateGradQuantizeParams {
  const void* h;
  const void* g;
  const float* omega;
  DType dtype;  // of h, g and dh
  void* dh;
  uint8_t* q;
  float* scales;
  float* d_omega_tiles;
  int64_t rows;
  int64_t cols;  // of dh and h
  Activation activation;
  bool pow2_scale;
};

// The backward of the routing-weighted activation b[r] = omega[r] * act(h[r]) (the rows the
// bf16 expert MLP's second product reads in moe_xla/product_combine.py's derivative): with
// g the cotangent of b, the gradients of sum_r <b[r], g[r]> in h and in omega:
//   h      [rows, 2F] (gated) or [rows, F], of dtype; g [rows, F] of dtype; omega [rows] float32
//   dh     [rows, cols] of dtype: activate_grad with da = omega[r] * g[r] formed in float32
//          (not rounded), rounded to dtype (RNE)
//   d_omega [rows] float32: sum_f g[r, f] * a[r, f], a = activate(h) rounded to dtype (the a
//          the forward multiplied), products and sum in float32, summation order unspecified
//   weighted [rows, F] of dtype: b[r, f] = omega[r] * a[r, f] in float32, rounded to dtype
//          (the rows the second product's weight gradient reads). It may be g's buffer: each
//          element of g is read before the element of b at the same place is written.
// One pass over h and g; rows are independent.
struct ActivateWeightedGradParams {
  const void* h;
  const void* g;
  const float* omega;
  DType dtype;  // of h, g, dh and weighted
  void* dh;
  float* d_omega;
  void* weighted;  // may equal g
  int64_t rows;
  int64_t cols;  // of dh and h
  Activation activation;
};

}  // namespace moe_xla

#endif  // MOE_XLA_COMMON_EXPERT_ACTIVATION_H_
