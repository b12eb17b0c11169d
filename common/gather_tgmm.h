// Framework-free contract of the gather grouped weight gradient: the gradient of the first
// expert GEMM of a MoE layer (common/gather_gemm.h) with respect to its weights, read
// straight from the tokens through the row map, with no gathered copy of them.
//
//   x [T, K], src [M] int32, dy [M, N], group_sizes [G] int32 -> out [G, K, N]
//   (or out [G, N, K], each block transposed, with transpose_out)
//
// The M rows of dy are split into consecutive groups by `group_sizes`, clamped as in
// common/grouped_gemm.h (start_0 = 0, size'_g = clamp(group_sizes[g], 0, M - start_g),
// start_{g+1} = start_g + size'_g). For every group g,
//   out[g] = sum_{r in [start_g, start_g + size'_g)} x_r^T (outer) dy[r, :]
// (with transpose_out, out[g] = sum dy[r, :]^T (outer) x_r, the transpose of that block)
// accumulated in float32, where x_r = x[src[r], :] when src[r] lies in [0, T) and a zero
// row otherwise (so that row contributes 0 * dy[r, :]). Rows at or past start_G belong to
// no group, and no group's sum reads a row of dy outside its own rows: non-finite values
// there never reach out. A group with no rows gets an exactly zero block. This is
// tgmm(gather_rows(x, src), dy) of common/grouped_gemm.h and common/gather_rows.h, without
// the gathered copy of x.
// All arrays are dense row-major.
#ifndef MOE_XLA_COMMON_GATHER_TGMM_H_
#define MOE_XLA_COMMON_GATHER_TGMM_H_

#include <cstdint>

#include "common/grouped_gemm.h"  // DType

namespace moe_xla {

struct GatherTgmmParams {
  DType in_dtype;              // dtype of x and dy
  DType out_dtype;
  const void* x;               // [tokens, k]
  const int32_t* src;          // [m]: the row of x that row r of dy pairs with
  const void* dy;              // [m, n]
  const int32_t* group_sizes;  // [num_groups]; device memory for CUDA kernels
  void* out;                   // [num_groups, k, n], or [num_groups, n, k] if transpose_out
  int64_t tokens;              // T
  int64_t m;
  int64_t k;
  int64_t n;
  int64_t num_groups;
  bool transpose_out;
};

}  // namespace moe_xla

#endif  // MOE_XLA_COMMON_GATHER_TGMM_H_
