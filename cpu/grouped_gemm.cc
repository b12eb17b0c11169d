#include "cpu/grouped_gemm.h"

#include <algorithm>
#include <cstdint>
#include <vector>

#include "cpu/dtype.h"

namespace moe_xla::cpu {
namespace {

constexpr int64_t kRowBlock = 32;

// Converts rows [row0, row0 + rows) x cols of a row-major [*, ld] array to float.
void load_block(const void* base, DType t, int64_t row0, int64_t rows, int64_t cols, int64_t ld,
                float* dst) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) dst[r * cols + c] = load_as_float(base, (row0 + r) * ld + c, t);
  }
}

// out[rows g] = lhs[rows g] @ B_g with B_g = rhs[g] ([K,N]) or rhs[g]^T (rhs[g] is [N,K]).
void gmm(const GroupedGemmParams& p) {
  const int64_t m = p.m, k = p.k, n = p.n;
  const bool transposed = p.layout == GroupedLayout::kGmmTransposed;
  std::vector<float> b(static_cast<size_t>(k * n));
  std::vector<float> a(static_cast<size_t>(kRowBlock * k));
  std::vector<float> c(static_cast<size_t>(kRowBlock * n));
  int64_t start = 0;
  for (int64_t g = 0; g < p.num_groups; ++g) {
    const int64_t size = clamp_group_size(p.group_sizes[g], start, m);
    if (size == 0) continue;
    const int64_t b_offset = g * k * n;
    for (int64_t kk = 0; kk < k; ++kk) {
      for (int64_t nn = 0; nn < n; ++nn) {
        const int64_t src = transposed ? nn * k + kk : kk * n + nn;
        b[kk * n + nn] = load_as_float(p.rhs, b_offset + src, p.in_dtype);
      }
    }
    for (int64_t row0 = start; row0 < start + size; row0 += kRowBlock) {
      const int64_t rows = std::min(kRowBlock, start + size - row0);
      load_block(p.lhs, p.in_dtype, row0, rows, k, k, a.data());
      std::fill(c.begin(), c.end(), 0.0f);
      for (int64_t r = 0; r < rows; ++r) {
        float* c_row = c.data() + r * n;
        for (int64_t kk = 0; kk < k; ++kk) {
          const float a_rk = a[r * k + kk];
          const float* b_row = b.data() + kk * n;
          for (int64_t nn = 0; nn < n; ++nn) c_row[nn] += a_rk * b_row[nn];
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t nn = 0; nn < n; ++nn) store_from_float(p.out, (row0 + r) * n + nn, p.out_dtype, c[r * n + nn]);
      }
    }
    start += size;
  }
  for (int64_t i = start * n; i < m * n; ++i) store_from_float(p.out, i, p.out_dtype, 0.0f);
}

// out[g] = lhs[rows g]^T @ rhs[rows g], summed over the group's rows in order.
void tgmm(const GroupedGemmParams& p) {
  const int64_t m = p.m, k = p.k, n = p.n;
  std::vector<float> acc(static_cast<size_t>(k * n));
  std::vector<float> a(static_cast<size_t>(kRowBlock * k));
  std::vector<float> b(static_cast<size_t>(kRowBlock * n));
  int64_t start = 0;
  for (int64_t g = 0; g < p.num_groups; ++g) {
    const int64_t size = clamp_group_size(p.group_sizes[g], start, m);
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int64_t row0 = start; row0 < start + size; row0 += kRowBlock) {
      const int64_t rows = std::min(kRowBlock, start + size - row0);
      load_block(p.lhs, p.in_dtype, row0, rows, k, k, a.data());
      load_block(p.rhs, p.in_dtype, row0, rows, n, n, b.data());
      for (int64_t r = 0; r < rows; ++r) {
        const float* b_row = b.data() + r * n;
        for (int64_t kk = 0; kk < k; ++kk) {
          const float a_rk = a[r * k + kk];
          float* acc_row = acc.data() + kk * n;
          for (int64_t nn = 0; nn < n; ++nn) acc_row[nn] += a_rk * b_row[nn];
        }
      }
    }
    for (int64_t i = 0; i < k * n; ++i) store_from_float(p.out, g * k * n + i, p.out_dtype, acc[i]);
    start += size;
  }
}

}  // namespace

void grouped_gemm(const GroupedGemmParams& p) {
  if (p.layout == GroupedLayout::kTgmm) {
    tgmm(p);
  } else {
    gmm(p);
  }
}

}  // namespace moe_xla::cpu
