// CUTLASS grouped GEMM instantiation: bf16 inputs/outputs, layout kGmmTransposed,
// tile config kCoop128x256Cluster1x1
// (cooperative 128x256x64, cluster 1x1; see cutlass_grouped.cuh).
// One instantiation per file so they compile in parallel.
#include "cuda/cutlass_grouped.cuh"

MOE_XLA_INSTANTIATE_CUTLASS_GROUPED(kBF16, kGmmTransposed, kCoop128x256Cluster1x1)
