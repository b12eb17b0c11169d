// Argument checks shared by the dispatchers of the gather products (gather_gemm.cu,
// gather_tgmm.cu): their Hopper kernels take bf16 operands, bf16 or f32 output, rows of
// whole 16-byte chunks and 16-byte aligned arrays, and keep row and column indices in
// int32.
#ifndef MOE_XLA_CUDA_GATHER_CHECKS_H_
#define MOE_XLA_CUDA_GATHER_CHECKS_H_

#include <cstdint>
#include <string>

#include "common/grouped_gemm.h"
#include "common/status.h"

namespace moe_xla {
namespace cuda {
namespace detail {

// Largest T, M, K, N and G: row indices plus a tile stay in int32 in the kernels.
constexpr int64_t kGatherMaxDim = (int64_t{1} << 31) - 256;

inline bool aligned16(const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15u) == 0; }

// The sizes of a gather product: T tokens (rows of x), M rows, K columns of x, N columns
// of the other operand, G groups.
struct GatherDims {
  int64_t tokens, m, k, n, num_groups;
};

// Ok, or an InvalidArgument naming the field, what was expected and what was given:
// `operands` (e.g. "x and w") must be bf16, the output bf16 or f32, every size within
// [0, kGatherMaxDim], K and N multiples of 8; `k_rows` and `n_rows` name the arrays whose
// rows K and N are (e.g. "x", "w and out"), for the messages.
inline Status validate_gather(const char* op, const char* operands, DType in_dtype, DType out_dtype,
                              const GatherDims& d, const char* k_rows, const char* n_rows) {
  const std::string prefix = std::string(op) + ": ";
  if (in_dtype != DType::kBF16) {
    return Status::InvalidArgument(prefix + operands + " must be bf16, got " + dtype_name(in_dtype));
  }
  if (out_dtype != DType::kBF16 && out_dtype != DType::kF32) {
    return Status::InvalidArgument(prefix + "output must be bf16 or f32, got " + dtype_name(out_dtype));
  }
  const int64_t dims[] = {d.tokens, d.m, d.k, d.n, d.num_groups};
  const char* const names[] = {"tokens", "m", "k", "n", "num_groups"};
  for (int i = 0; i < 5; ++i) {
    if (dims[i] < 0 || dims[i] > kGatherMaxDim) {
      return Status::InvalidArgument(prefix + names[i] + " = " + std::to_string(dims[i]) +
                                     " is outside [0, 2^31 - 256]");
    }
  }
  if (d.k % 8 != 0) {
    return Status::InvalidArgument(prefix + "k = " + std::to_string(d.k) +
                                   " must be a multiple of 8 (16-byte rows of " + k_rows + ")");
  }
  if (d.n % 8 != 0) {
    return Status::InvalidArgument(prefix + "n = " + std::to_string(d.n) +
                                   " must be a multiple of 8 (16-byte rows of " + n_rows + ")");
  }
  return Status();
}

}  // namespace detail
}  // namespace cuda
}  // namespace moe_xla

#endif  // MOE_XLA_CUDA_GATHER_CHECKS_H_
