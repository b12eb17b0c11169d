// Framework-free contract of the gather grouped product: the first expert GEMM of a MoE
// layer read straight from the tokens through the row map, with no gathered copy of them.
//
//   x [T, K], src [M] int32, w [G, K, N] (N contiguous), group_sizes [G] int32 -> out [M, N]
//   or, with transpose_w, w [G, N, K] (K contiguous: each expert's matrix transposed)
//
// The M output rows are split into consecutive groups by `group_sizes`, clamped as in
// common/grouped_gemm.h (start_0 = 0, size'_g = clamp(group_sizes[g], 0, M - start_g),
// start_{g+1} = start_g + size'_g). For a row r of group g,
//   out[r, :] = x[src[r], :] @ w[g]        accumulated in float32
//   (out[r, :] = x[src[r], :] @ w[g]^T with transpose_w),
// where a row whose src[r] lies outside [0, T) reads a zero row of x (so its output row is
// 0 @ w[g]). Rows at or past start_G belong to no group and are zero.
// With `activated`, the float32 product h[r] = x[src[r]] @ w[g] (not rounded) goes through
// the expert activation `activation` of common/expert_activation.h before its one rounding
// to out_dtype (transpose_w false):
//   gated (swiglu, geglu; N = 2F, w[g] = gate | up):  out [M, F],  out[r, c] = g(h[r, c]) * h[r, F + c]
//   plain (gelu, silu, relu):                          out [M, N],  out[r, c] = g(h[r, c])
// Rows with no group stay zero (g(0) = 0 for every g).
// All arrays are dense row-major.
#ifndef MOE_XLA_COMMON_GATHER_GEMM_H_
#define MOE_XLA_COMMON_GATHER_GEMM_H_

#include <cstdint>

#include "common/expert_activation.h"  // Activation
#include "common/grouped_gemm.h"       // DType

namespace moe_xla {

struct GatherGemmParams {
  DType in_dtype;              // dtype of x and w
  DType out_dtype;
  const void* x;               // [tokens, k]
  const int32_t* src;          // [m]: the row of x that output row r reads
  const void* w;               // [num_groups, k, n], or [num_groups, n, k] if transpose_w
  const int32_t* group_sizes;  // [num_groups]; device memory for CUDA kernels
  void* out;                   // [m, n], or [m, n / 2] activated by a gated activation
  int64_t tokens;              // T
  int64_t m;
  int64_t k;
  int64_t n;
  int64_t num_groups;
  bool transpose_w;            // w holds each group's matrix transposed, [n, k]
  bool activated;              // out = activation(product) (above); false: out = product
  Activation activation;       // read only when activated
};

}  // namespace moe_xla

#endif  // MOE_XLA_COMMON_GATHER_GEMM_H_
