// CUTLASS grouped GEMM instantiation: bf16 inputs/outputs,
// layout kGmmTransposed, tile config kLarge (see cutlass_grouped.cuh).
// One instantiation per file so they compile in parallel.
#include "cuda/cutlass_grouped.cuh"

MOE_XLA_INSTANTIATE_CUTLASS_GROUPED(kBF16, kGmmTransposed, kLarge)
