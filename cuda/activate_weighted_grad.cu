// CUDA backward of the routing-weighted expert activation. One warp per row: each lane
// takes 8 consecutive columns of the gate (or h), the up half and g at a time, as one
// aligned access each where F % 8 == 0 (else element by element), computes both halves of
// d h from one g(gate) and g'(gate), adds g * a to its part of the row's d omega, which a
// warp reduction finishes, and stores b = omega * a where it read g. weighted may be g's
// buffer (neither pointer is __restrict__): a lane writes only the columns of b it has
// already read of g.
#include "cuda/activate_weighted_grad.h"

#include <cuda_runtime.h>

#include <cstdint>

#include "common/expert_activation.h"
#include "common/status.h"
#include "cuda/device.h"
#include "cuda/fp8_lanes.cuh"  // detail::Elem, detail::Lane

namespace moe_xla {
namespace cuda {
namespace {

using detail::aligned;
using detail::Elem;
using detail::kLaneCols;
using detail::Lane;
using detail::store_lane;

constexpr int kThreads = 256;
constexpr int kWarpSize = 32;
constexpr int kRowsPerCta = kThreads / kWarpSize;

// One element: d gate (or d h), d up (gated only) and a, rounded to D as the forward stored
// it (for the row's d omega term g * a and for b = omega * a).
struct ElementGrad {
  float d_gate, d_up, a;
};

template <DType D>
__device__ __forceinline__ ElementGrad element_grad(Activation act, float gate, float up, float g, float omega) {
  const float da = omega * g;
  GatedGrad d{0.0f, 0.0f, 0.0f};
  if (is_gated(act)) {
    d = gated_grad(act, gate, up, da);
  } else {
    d.a = activate(act, gate, 0.0f);
    d.d_gate = activate_grad(act, false, gate, 0.0f, da);
  }
  return {d.d_gate, d.d_up, Elem<D>::to_float(Elem<D>::from_float(d.a))};
}

// kVector: F % 8 == 0 and h, g, dh and weighted aligned for Lane accesses.
template <DType D, bool kVector>
__global__ void __launch_bounds__(kThreads) activate_weighted_grad_rows(
    const typename Elem<D>::Bits* __restrict__ h, const typename Elem<D>::Bits* g, const float* __restrict__ omega,
    typename Elem<D>::Bits* __restrict__ dh, float* __restrict__ d_omega, typename Elem<D>::Bits* weighted,
    int64_t rows, int64_t f, Activation act) {
  using Bits = typename Elem<D>::Bits;
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kRowsPerCta + threadIdx.x / kWarpSize;
  if (r >= rows) return;
  const int lane = threadIdx.x % kWarpSize;
  const bool gated = is_gated(act);
  const int64_t cols = gated ? 2 * f : f;
  const Bits* h_row = h + r * cols;
  const Bits* g_row = g + r * f;
  Bits* dh_row = dh + r * cols;
  Bits* b_row = weighted + r * f;
  const float w = __ldg(omega + r);
  float dot = 0.0f;
  if constexpr (kVector) {
    for (int64_t e = static_cast<int64_t>(lane) * kLaneCols; e < f; e += kWarpSize * kLaneCols) {
      const Lane<Bits> x = *reinterpret_cast<const Lane<Bits>*>(h_row + e);
      const Lane<Bits> gl = *reinterpret_cast<const Lane<Bits>*>(g_row + e);
      Lane<Bits> u{};
      if (gated) u = *reinterpret_cast<const Lane<Bits>*>(h_row + f + e);
      Lane<Bits> d_gate, d_up, b;
#pragma unroll
      for (int j = 0; j < kLaneCols; ++j) {
        const float gj = Elem<D>::to_float(gl.get(j));
        const ElementGrad d = element_grad<D>(act, Elem<D>::to_float(x.get(j)), Elem<D>::to_float(u.get(j)), gj, w);
        d_gate.set(j, Elem<D>::from_float(d.d_gate));
        d_up.set(j, Elem<D>::from_float(d.d_up));
        b.set(j, Elem<D>::from_float(w * d.a));
        dot += gj * d.a;
      }
      store_lane<true>(dh_row + e, d_gate, kLaneCols);
      if (gated) store_lane<true>(dh_row + f + e, d_up, kLaneCols);
      store_lane<true>(b_row + e, b, kLaneCols);
    }
  } else {
    for (int64_t e = lane; e < f; e += kWarpSize) {
      const float up = gated ? Elem<D>::to_float(h_row[f + e]) : 0.0f;
      const float ge = Elem<D>::to_float(g_row[e]);
      const ElementGrad d = element_grad<D>(act, Elem<D>::to_float(h_row[e]), up, ge, w);
      dh_row[e] = Elem<D>::from_float(d.d_gate);
      if (gated) dh_row[f + e] = Elem<D>::from_float(d.d_up);
      b_row[e] = Elem<D>::from_float(w * d.a);
      dot += ge * d.a;
    }
  }
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, offset);
  if (lane == 0) d_omega[r] = dot;
}

template <DType D>
cudaError_t launch(const ActivateWeightedGradParams& p, int64_t f, cudaStream_t stream) {
  using Bits = typename Elem<D>::Bits;
  const auto* h = static_cast<const Bits*>(p.h);
  const auto* g = static_cast<const Bits*>(p.g);
  auto* dh = static_cast<Bits*>(p.dh);
  auto* weighted = static_cast<Bits*>(p.weighted);
  const bool vector = f % kLaneCols == 0 && aligned(h, sizeof(Lane<Bits>)) && aligned(g, sizeof(Lane<Bits>)) &&
                      aligned(dh, sizeof(Lane<Bits>)) && aligned(weighted, sizeof(Lane<Bits>));
  const int64_t ctas = (p.rows + kRowsPerCta - 1) / kRowsPerCta;
  if (ctas > 0x7fffffff) return cudaErrorInvalidConfiguration;
  const auto kernel = vector ? activate_weighted_grad_rows<D, true> : activate_weighted_grad_rows<D, false>;
  kernel<<<static_cast<unsigned>(ctas), kThreads, 0, stream>>>(h, g, p.omega, dh, p.d_omega, weighted, p.rows, f,
                                                                 p.activation);
  return cudaGetLastError();
}

}  // namespace

Status activate_weighted_grad(const ActivateWeightedGradParams& p, cudaStream_t stream) {
  MOE_XLA_RETURN_IF_ERROR(require_device(DeviceSupport::kSimt, "activate_weighted_grad"));
  if (p.rows < 0 || p.cols < 0) return Status::InvalidArgument("activate_weighted_grad: negative dimension");
  if (is_gated(p.activation) && p.cols % 2 != 0) {
    return Status::InvalidArgument("activate_weighted_grad: a gated activation needs an even number of columns");
  }
  if (p.rows == 0) return Status();
  const int64_t f = is_gated(p.activation) ? p.cols / 2 : p.cols;
  switch (p.dtype) {
    case DType::kF32: MOE_XLA_RETURN_IF_CUDA_ERROR(launch<DType::kF32>(p, f, stream)); break;
    case DType::kBF16: MOE_XLA_RETURN_IF_CUDA_ERROR(launch<DType::kBF16>(p, f, stream)); break;
    case DType::kF16: MOE_XLA_RETURN_IF_CUDA_ERROR(launch<DType::kF16>(p, f, stream)); break;
    default: return Status::InvalidArgument("activate_weighted_grad: unsupported dtype");
  }
  return Status();
}

}  // namespace cuda
}  // namespace moe_xla
