// CPU grouped products: see common/grouped_gemm.h for the contract.
#ifndef MOE_XLA_CPU_GROUPED_GEMM_H_
#define MOE_XLA_CPU_GROUPED_GEMM_H_

#include <cstdint>

#include "common/grouped_gemm.h"
#include "cpu/parallel.h"

namespace moe_xla::cpu {

// Runs the grouped product described by `p` on host memory (group_sizes too), its output
// tiles spread over up to `threads` threads: the caller's and helpers it starts through
// `schedule` (none when empty). Results are bitwise the same for any thread count.
void grouped_gemm(const GroupedGemmParams& p, int64_t threads = 1, const Schedule& schedule = {});

}  // namespace moe_xla::cpu

#endif  // MOE_XLA_CPU_GROUPED_GEMM_H_
