// CPU dispatch: a stable counting sort of the T*k (token, expert) assignments by expert.
// See common/routing.h for the contract (invalid expert ids land past every group).
#ifndef MOE_XLA_CPU_PERMUTE_H_
#define MOE_XLA_CPU_PERMUTE_H_

#include "common/routing.h"

namespace moe_xla::cpu {

// Fills p.x_sorted, p.group_sizes and p.row_map (host memory). Any expert id is accepted.
void permute(const PermuteParams& p);

}  // namespace moe_xla::cpu

#endif  // MOE_XLA_CPU_PERMUTE_H_
