// CPU backward of the routing-weighted expert activation: d h and d omega of
// sum_r <omega[r] act(h[r]), g[r]>, and b = omega * a (ActivateWeightedGradParams in
// common/expert_activation.h).
#ifndef MOE_XLA_CPU_ACTIVATE_WEIGHTED_GRAD_H_
#define MOE_XLA_CPU_ACTIVATE_WEIGHTED_GRAD_H_

#include "common/expert_activation.h"

namespace moe_xla::cpu {

// Fills p.dh, p.d_omega and p.weighted (host memory; weighted may be g's buffer); d_omega
// sums a row's products in column order.
void activate_weighted_grad(const ActivateWeightedGradParams& p);

}  // namespace moe_xla::cpu

#endif  // MOE_XLA_CPU_ACTIVATE_WEIGHTED_GRAD_H_
