// The expert activations of the MoE layer in float32, shared by the CPU and CUDA kernels
// that fuse them with the FP8 row quantisation (moe_xla/activations.py states the same
// functions in jnp):
//   gated, on h [rows, 2F] = gate | up:  a = g(gate) * up   swiglu: g = silu, geglu: g = gelu
//   plain, on h [rows, F]:               a = g(h)           gelu, silu, relu
//   silu(x) = x / (1 + exp(-x));  gelu(x) = x / 2 * (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
//   (the tanh approximation); relu(x) = max(x, 0), NaN kept.
// exp and tanh are the platform's float32 functions (within a few ulp of each other and of
// XLA's), so the activation is not bitwise the same across platforms; what the fused kernels
// guarantee bitwise is that q and scales quantise the a they return, rounded to its dtype.
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

}  // namespace moe_xla

#endif  // MOE_XLA_COMMON_EXPERT_ACTIVATION_H_
