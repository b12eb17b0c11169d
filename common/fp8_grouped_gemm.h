// Framework-free contract of the FP8 blockwise grouped product, shared by the CPU kernel
// (cpu/fp8_grouped_gemm.cc), the CUDA kernels (cuda/fp8_grouped_gemm.cu) and stated again
// in plain jnp by moe_xla/reference.py (gmm_fp8).
//
// Operands are quantised as common/fp8_blockwise.h says (float8_e4m3fn data, float32
// scales), both K-major (the contraction dimension K is the contiguous one):
//   lhs        [M, K]        1 x 128 row tiles,   lhs_scales [M, Kt]         Kt = ceil(K/128)
//   rhs        [G, N, K]     128 x 128 blocks,    rhs_scales [G, Kt, Nt]     Nt = ceil(N/128)
//   out        [M, N]        bfloat16 or float32
// rhs[g] is the expert's matrix transposed (n, k); the scale of element rhs[g, n, k] is
// rhs_scales[g, k / 128, n / 128]. Rows are split into groups by group_sizes, clamped as in
// common/grouped_gemm.h; rows past the last group are zero. For a row r of group g:
//
//   P_j[r, n] = sum over k in [128 j, min(128 (j + 1), K)) of e(lhs[r, k]) * e(rhs[g, n, k])
//   acc_0     = 0
//   acc_{j+1} = fma(fl(lhs_scales[r, j] * rhs_scales[g, j, n / 128]), P_j[r, n], acc_j)
//   out[r, n] = acc_Kt rounded to the output dtype (round to nearest even)
//
// e() is the float32 value of float8_e4m3fn bits (NaN for the NaN codes); every product
// e(a) * e(b) is exact in float32 (4-bit significands), so only the order of the sums in
// P_j can differ between implementations:
//   CPU and the CUDA SIMT path: sequential in k, float32, each sum rounded (bitwise equal);
//   the CUTLASS sm90 path: the tensor cores' order and internal precision inside each
//   block, then the same fma per block (CUTLASS's blockwise-scaled mainloop promotes the
//   block's partial sum with fl(s_a * s_b) in one fma). Its results differ from the CPU's
//   by a few float32 roundings of the block sums: a relative error near 2^-20 of
//   sum_j |fl(s_a s_b) P_j|.
// The forward of the FP8 gmm is this product with rhs = the weights' blocks transposed
// (w[g] [K, N] stored as [N, K]); the dgrad is the same product with rhs = the weights
// as stored ([K, N] read as [N' = K, K' = N]) and rhs_scales transposed.
#ifndef MOE_XLA_COMMON_FP8_GROUPED_GEMM_H_
#define MOE_XLA_COMMON_FP8_GROUPED_GEMM_H_

#include <cstdint>

#include "common/fp8_blockwise.h"
#include "common/grouped_gemm.h"

namespace moe_xla {

struct Fp8GroupedGemmParams {
  const uint8_t* lhs;          // [M, K] float8_e4m3fn bits
  const float* lhs_scales;     // [M, Kt]
  const uint8_t* rhs;          // [G, N, K] float8_e4m3fn bits
  const float* rhs_scales;     // [G, Kt, Nt]
  const int32_t* group_sizes;  // [G]; device memory for CUDA kernels
  void* out;                   // [M, N]
  DType out_dtype;             // kBF16 or kF32
  int64_t m;
  int64_t k;
  int64_t n;
  int64_t num_groups;
};

// The FP8 wgrad (tgmm_fp8): per group, the product of two operands quantised in 128 x 1
// column tiles along the rows (Fp8GroupColsParams, transposed), contracted over the rows:
//   lhs_t [K, 128 T] with lhs_scales [T, K]   (x of the layer's product)
//   rhs_t [N, 128 T] with rhs_scales [T, N]   (dy)
//   out   [G, K, N]  bfloat16 or float32,      T = group_col_tiles(M, G)
// with M the rows both were quantised from and the groups' tiles as that struct says.
// For group g with tiles t = first_tile(g) .. first_tile(g) + ceil(len_g / 128) - 1:
//
//   P_t[k, n] = sum over the 128 columns c of tile t of e(lhs_t[k, c]) * e(rhs_t[n, c])
//   acc       = 0, then per tile in order:
//   acc       = fma(fl(P_t[k, n] * lhs_scales[t, k]), rhs_scales[t, n], acc)
//   out[g, k, n] = acc rounded to the output dtype; 0 for a group with no rows
//
// The columns past a group's rows hold 0 in both operands and add nothing. The order per
// tile is CUTLASS's for per-row and per-column scales (its mainloop adds
// partial * s_a * s_b, left to right, contracted to one fma); the CPU kernel sums P_t
// sequentially in c, the tensor cores in their own order, so the GPU differs from the CPU
// by a few float32 roundings of each tile's partial sum.
struct Fp8WgradParams {
  const uint8_t* lhs_t;        // [K, 128 T] float8_e4m3fn bits
  const float* lhs_scales;     // [T, K]
  const uint8_t* rhs_t;        // [N, 128 T] float8_e4m3fn bits
  const float* rhs_scales;     // [T, N]
  const int32_t* group_sizes;  // [G]; device memory for CUDA kernels
  void* out;                   // [G, K, N]
  DType out_dtype;             // kBF16 or kF32
  int64_t m;                   // rows the operands were quantised from
  int64_t k;
  int64_t n;
  int64_t num_groups;
};

}  // namespace moe_xla

#endif  // MOE_XLA_COMMON_FP8_GROUPED_GEMM_H_
