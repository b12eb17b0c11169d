// CPU backward of the routing-weighted expert activation, row by row: each element of g is
// used once, for the gate (or h) column, the up column and the row's d omega term, then b
// is stored in its place (weighted may be g's buffer).
#include "cpu/activate_weighted_grad.h"

#include <cstdint>

#include "cpu/dtype.h"

namespace moe_xla::cpu {

void activate_weighted_grad(const ActivateWeightedGradParams& p) {
  const bool gated = is_gated(p.activation);
  const int64_t f = gated ? p.cols / 2 : p.cols;
  for (int64_t r = 0; r < p.rows; ++r) {
    const float omega = p.omega[r];
    float d_omega = 0.0f;
    for (int64_t e = 0; e < f; ++e) {
      const float gate = load_as_float(p.h, r * p.cols + e, p.dtype);
      const float up = gated ? load_as_float(p.h, r * p.cols + f + e, p.dtype) : 0.0f;
      const float g = load_as_float(p.g, r * f + e, p.dtype);
      const float da = omega * g;
      store_from_float(p.dh, r * p.cols + e, p.dtype, activate_grad(p.activation, false, gate, up, da));
      if (gated) store_from_float(p.dh, r * p.cols + f + e, p.dtype, activate_grad(p.activation, true, gate, up, da));
      const float a = round_to(activate(p.activation, gate, up), p.dtype);
      d_omega += g * a;
      store_from_float(p.weighted, r * f + e, p.dtype, omega * a);
    }
    p.d_omega[r] = d_omega;
  }
}

}  // namespace moe_xla::cpu
