// Framework-free contract of gather_rows, shared by the CPU kernel (cpu/gather_rows.cc)
// and the CUDA kernel (cuda/gather_rows.cu):
//
//   values [num_values, cols] of dtype; src [rows] int32; factor [rows] float32 or nullptr
//   out    [rows, cols] of dtype:
//     out[r] = values[src[r]]                                  (no factor: a bitwise copy)
//     out[r, c] = rnd(fp8::scaled_element(factor[r], values[src[r], c]))   (with factor)
//   where 0 <= src[r] < num_values, and +0 everywhere else (any src: no other row is read,
//   the factor of such a row is not read either). rnd is the one rounding of the float32
//   product to dtype (round to nearest even); scaled_element flushes float32 subnormal
//   operands and products of magnitude at most 2^-126 to zeros of their sign, so the
//   product is the same whether a platform multiplies with denormals flushed or not.
#ifndef MOE_XLA_COMMON_GATHER_ROWS_H_
#define MOE_XLA_COMMON_GATHER_ROWS_H_

#include <cstdint>

#include "common/fp8_blockwise.h"  // fp8::scaled_element
#include "common/grouped_gemm.h"   // DType

namespace moe_xla {

struct GatherRowsParams {
  const void* values;     // [num_values, cols], dtype
  DType dtype;            // of values and out
  const int32_t* src;     // [rows]; device memory for the CUDA kernel, as factor
  const float* factor;    // [rows], or nullptr for a plain copy
  int64_t num_values;
  void* out;              // [rows, cols], dtype
  int64_t rows;
  int64_t cols;
};

}  // namespace moe_xla

#endif  // MOE_XLA_COMMON_GATHER_ROWS_H_
