// Framework-free contract of the three grouped products (gmm, gmm with transposed rhs,
// tgmm), shared by the CPU kernels (cpu/) and the CUDA kernels (cuda/).
//
// Rows of the ragged dimension M are split into consecutive groups by `group_sizes`.
// Sizes are clamped so that no group reaches outside [0, M), whatever the data:
//   size'_g  = clamp(group_sizes[g], 0, M - start_g),  start_0 = 0,
//   start_{g+1} = start_g + size'_g.
// Rows at or past start_G belong to no group.
//
//   kGmm:           out[rows g] = lhs[rows g] @ rhs[g]      lhs [M,K] rhs [G,K,N] out [M,N]
//   kGmmTransposed: out[rows g] = lhs[rows g] @ rhs[g]^T    lhs [M,K] rhs [G,N,K] out [M,N]
//   kTgmm:          out[g] = lhs[rows g]^T @ rhs[rows g]    lhs [M,K] rhs [M,N]   out [G,K,N]
// gmm rows that belong to no group are zero; tgmm blocks of empty groups are zero.
// All arrays are dense row-major; products accumulate in float32.
#ifndef MOE_XLA_COMMON_GROUPED_GEMM_H_
#define MOE_XLA_COMMON_GROUPED_GEMM_H_

#include <cstddef>
#include <cstdint>

#if defined(__CUDACC__)
#define MOE_XLA_HOST_DEVICE __host__ __device__
#else
#define MOE_XLA_HOST_DEVICE
#endif

namespace moe_xla {

enum class DType : int32_t { kF32 = 0, kBF16 = 1, kF16 = 2 };

// Bytes of one element of d.
MOE_XLA_HOST_DEVICE inline size_t dtype_bytes(DType d) { return d == DType::kF32 ? 4 : 2; }

// Short name of d for messages: "f32", "bf16", "f16".
inline const char* dtype_name(DType d) {
  return d == DType::kF32 ? "f32" : d == DType::kBF16 ? "bf16" : "f16";
}

enum class GroupedLayout : int32_t { kGmm = 0, kGmmTransposed = 1, kTgmm = 2 };

struct GroupedGemmParams {
  GroupedLayout layout;
  DType in_dtype;              // dtype of lhs and rhs
  DType out_dtype;
  const void* lhs;
  const void* rhs;
  const int32_t* group_sizes;  // [num_groups]; device memory for CUDA kernels
  void* out;
  int64_t m;                   // the ragged dimension (rows of lhs)
  int64_t k;
  int64_t n;
  int64_t num_groups;
};

// Clamped size of a group that starts at `start` (see the header comment).
MOE_XLA_HOST_DEVICE inline int64_t clamp_group_size(int32_t size, int64_t start, int64_t m) {
  const int64_t room = m - start;
  return size <= 0 ? 0 : (size < room ? size : room);
}

}  // namespace moe_xla

#endif  // MOE_XLA_COMMON_GROUPED_GEMM_H_
