// CPU FP8 blockwise grouped product: see common/fp8_grouped_gemm.h for the contract.
#ifndef MOE_XLA_CPU_FP8_GROUPED_GEMM_H_
#define MOE_XLA_CPU_FP8_GROUPED_GEMM_H_

#include <cstdint>

#include "common/fp8_grouped_gemm.h"
#include "cpu/parallel.h"

namespace moe_xla::cpu {

// Runs the product on host memory (group_sizes too) in the contract's order: each block
// sum sequential in k, one fma per 128-deep block. Output tiles are spread over up to
// `threads` threads (the caller's and helpers it starts through `schedule`); results are
// bitwise the same for any thread count.
void fp8_grouped_gemm(const Fp8GroupedGemmParams& p, int64_t threads = 1, const Schedule& schedule = {});

}  // namespace moe_xla::cpu

#endif  // MOE_XLA_CPU_FP8_GROUPED_GEMM_H_
