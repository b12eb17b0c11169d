// CPU combine: y[t] = sum_j weights[t, j] * y_sorted[row_map[t*k + j]], in j order, in
// float32. See common/routing.h for the contract (out-of-range row_map entries add 0).
#ifndef MOE_XLA_CPU_UNPERMUTE_H_
#define MOE_XLA_CPU_UNPERMUTE_H_

#include "common/routing.h"

namespace moe_xla::cpu {

// Fills p.y (host memory). Any row_map content is accepted.
void unpermute(const UnpermuteParams& p);

}  // namespace moe_xla::cpu

#endif  // MOE_XLA_CPU_UNPERMUTE_H_
