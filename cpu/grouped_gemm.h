// CPU grouped products: see common/grouped_gemm.h for the contract.
#ifndef MOE_XLA_CPU_GROUPED_GEMM_H_
#define MOE_XLA_CPU_GROUPED_GEMM_H_

#include "common/grouped_gemm.h"

namespace moe_xla::cpu {

// Runs the grouped product described by `p` on host memory (group_sizes too).
void grouped_gemm(const GroupedGemmParams& p);

}  // namespace moe_xla::cpu

#endif  // MOE_XLA_CPU_GROUPED_GEMM_H_
