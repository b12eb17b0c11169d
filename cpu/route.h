// CPU routing: logits [T, E] -> top-k weights and expert ids. See common/routing.h for
// the contract (softmax / sigmoid scores, bias, group-limited selection, NaN handling,
// tie-breaking).
#ifndef MOE_XLA_CPU_ROUTE_H_
#define MOE_XLA_CPU_ROUTE_H_

#include "common/routing.h"

namespace moe_xla::cpu {

// Computes p.weights and p.expert_ids from p.logits (host memory). Expects valid params
// (1 <= top_k <= E, n_groups divides E, 1 <= topk_groups <= n_groups); the FFI layer
// checks them.
void route(const RouteParams& p);

}  // namespace moe_xla::cpu

#endif  // MOE_XLA_CPU_ROUTE_H_
