// CPU route_grad: the vector-Jacobian product of route's weights in the logits for fixed
// expert ids. See common/routing.h for the contract.
#ifndef MOE_XLA_CPU_ROUTE_GRAD_H_
#define MOE_XLA_CPU_ROUTE_GRAD_H_

#include "common/routing.h"

namespace moe_xla::cpu {

// Computes p.d_logits from p.logits, p.expert_ids and p.d_weights (host memory). Expects
// valid params (the FFI layer checks them); any expert id is safe.
void route_grad(const RouteGradParams& p);

}  // namespace moe_xla::cpu

#endif  // MOE_XLA_CPU_ROUTE_GRAD_H_
