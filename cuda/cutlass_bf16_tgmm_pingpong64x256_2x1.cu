// CUTLASS grouped GEMM instantiation: bf16 inputs/outputs, layout kTgmm,
// tile config kPingpong64x256Cluster2x1
// (pingpong 64x256x64, cluster 2x1; see cutlass_grouped.cuh).
// One instantiation per file so they compile in parallel.
#include "cuda/cutlass_grouped.cuh"

MOE_XLA_INSTANTIATE_CUTLASS_GROUPED(kBF16, kTgmm, kPingpong64x256Cluster2x1)
