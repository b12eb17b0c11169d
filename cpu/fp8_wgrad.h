// CPU FP8 wgrad (tgmm_fp8): see common/fp8_grouped_gemm.h, Fp8WgradParams, for the contract.
#ifndef MOE_XLA_CPU_FP8_WGRAD_H_
#define MOE_XLA_CPU_FP8_WGRAD_H_

#include <cstdint>

#include "common/fp8_grouped_gemm.h"
#include "cpu/parallel.h"

namespace moe_xla::cpu {

// Runs the wgrad on host memory (group_sizes too) in the contract's order: each tile's sum
// sequential over its 128 columns, then one fma per tile. Output tiles are spread over up
// to `threads` threads (the caller's and helpers it starts through `schedule`); results
// are bitwise the same for any thread count.
void fp8_wgrad(const Fp8WgradParams& p, int64_t threads = 1, const Schedule& schedule = {});

}  // namespace moe_xla::cpu

#endif  // MOE_XLA_CPU_FP8_WGRAD_H_
