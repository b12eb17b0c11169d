// The CPU grouped products against a direct float64 evaluation of common/grouped_gemm.h,
// on random data with empty groups, a sum of sizes below and above M, and negative sizes;
// and bitwise equal results with 1 and 3 threads, and for the same rows inside a larger M.
#include "cpu/grouped_gemm.h"

#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <random>
#include <thread>
#include <vector>

#include "cpu/dtype.h"

namespace moe_xla::cpu {
namespace {

// Direct definition, float64; returns the expected output for p (in float).
std::vector<double> reference(const GroupedGemmParams& p) {
  const int64_t m = p.m, k = p.k, n = p.n;
  const bool tgmm = p.layout == GroupedLayout::kTgmm;
  std::vector<double> out(tgmm ? p.num_groups * k * n : m * n, 0.0);
  auto lhs = [&](int64_t i, int64_t j) { return double(load_as_float(p.lhs, i * k + j, p.in_dtype)); };
  int64_t start = 0;
  for (int64_t g = 0; g < p.num_groups; ++g) {
    const int64_t size = clamp_group_size(p.group_sizes[g], start, m);
    for (int64_t r = start; r < start + size; ++r) {
      for (int64_t kk = 0; kk < k; ++kk) {
        for (int64_t nn = 0; nn < n; ++nn) {
          if (tgmm) {
            out[(g * k + kk) * n + nn] += lhs(r, kk) * load_as_float(p.rhs, r * n + nn, p.in_dtype);
          } else {
            const int64_t idx = p.layout == GroupedLayout::kGmm ? (g * k + kk) * n + nn : (g * n + nn) * k + kk;
            out[r * n + nn] += lhs(r, kk) * load_as_float(p.rhs, idx, p.in_dtype);
          }
        }
      }
    }
    start += size;
  }
  return out;
}

int check(GroupedLayout layout, DType dt, int64_t m, int64_t k, int64_t n, std::vector<int32_t> sizes,
          std::mt19937& rng) {
  const int64_t g = static_cast<int64_t>(sizes.size());
  const bool tgmm = layout == GroupedLayout::kTgmm;
  const size_t width = dtype_bytes(dt);
  std::normal_distribution<float> normal;
  std::vector<unsigned char> lhs(m * k * width), rhs((tgmm ? m * n : g * k * n) * width);
  for (int64_t i = 0; i < m * k; ++i) store_from_float(lhs.data(), i, dt, normal(rng));
  for (size_t i = 0; i < rhs.size() / width; ++i) store_from_float(rhs.data(), i, dt, normal(rng));
  const int64_t out_count = tgmm ? g * k * n : m * n;
  std::vector<float> out(out_count, NAN);
  GroupedGemmParams p{layout, dt, DType::kF32, lhs.data(), rhs.data(), sizes.data(), out.data(), m, k, n, g};
  grouped_gemm(p);
  const std::vector<double> ref = reference(p);
  // Three threads (helpers on std::threads) must give the same bits.
  std::vector<float> threaded(out_count, NAN);
  std::vector<std::thread> helpers;
  GroupedGemmParams q = p;
  q.out = threaded.data();
  grouped_gemm(q, 3, [&helpers](std::function<void()> task) { helpers.emplace_back(std::move(task)); });
  for (std::thread& h : helpers) h.join();
  const bool same = std::memcmp(out.data(), threaded.data(), out_count * sizeof(float)) == 0;
  double err = 0, norm = 0;
  for (int64_t i = 0; i < out_count; ++i) {
    err += (out[i] - ref[i]) * (out[i] - ref[i]);
    norm += ref[i] * ref[i];
  }
  const double rel = std::sqrt(err) / std::max(std::sqrt(norm), 1e-30);
  const bool ok = same && std::isfinite(rel) && (rel < 1e-5 || (norm == 0 && err == 0));
  std::printf("%s layout=%d dtype=%d m=%lld k=%lld n=%lld g=%lld rel_err=%.3g threads_bitwise=%d\n",
              ok ? "ok  " : "FAIL", int(layout), int(dt), (long long)m, (long long)k, (long long)n, (long long)g, rel,
              int(same));
  return ok ? 0 : 1;
}

// gmm of the first m rows alone and inside an M = m + 77 buffer (the rest in no group, as
// in an expert-parallel receive buffer) must give the same bits for those rows.
int check_rows_independent_of_m(GroupedLayout layout, std::mt19937& rng) {
  const int64_t m = 300, k = 70, n = 300, big = m + 77;
  std::vector<int32_t> sizes = {100, 0, 130, 70};
  std::normal_distribution<float> normal;
  std::vector<float> lhs(big * k), rhs(sizes.size() * k * n), small_out(m * n), big_out(big * n);
  for (float& v : lhs) v = normal(rng);
  for (float& v : rhs) v = normal(rng);
  const int64_t g = static_cast<int64_t>(sizes.size());
  grouped_gemm({layout, DType::kF32, DType::kF32, lhs.data(), rhs.data(), sizes.data(), small_out.data(), m, k, n, g});
  grouped_gemm({layout, DType::kF32, DType::kF32, lhs.data(), rhs.data(), sizes.data(), big_out.data(), big, k, n, g});
  bool same = std::memcmp(small_out.data(), big_out.data(), m * n * sizeof(float)) == 0;
  for (int64_t i = m * n; i < big * n; ++i) same &= big_out[i] == 0.0f;
  std::printf("%s layout=%d rows bitwise equal inside a larger M, rows past the groups zero\n", same ? "ok  " : "FAIL",
              int(layout));
  return same ? 0 : 1;
}

}  // namespace
}  // namespace moe_xla::cpu

int main() {
  using namespace moe_xla;
  std::mt19937 rng(0);
  int failures = 0;
  for (auto layout : {GroupedLayout::kGmm, GroupedLayout::kGmmTransposed, GroupedLayout::kTgmm}) {
    for (auto dt : {DType::kF32, DType::kBF16, DType::kF16}) {
      failures += cpu::check(layout, dt, 37, 13, 11, {0, 5, 0, 20, 3}, rng);        // sum < M
      failures += cpu::check(layout, dt, 64, 8, 24, {64}, rng);                     // G = 1
      failures += cpu::check(layout, dt, 40, 7, 9, {30, -4, 25, 100}, rng);         // negative, sum > M
      failures += cpu::check(layout, dt, 0, 5, 3, {0, 0}, rng);                     // M = 0
      failures += cpu::check(layout, dt, 700, 300, 530, {130, 0, 400, 90}, rng);    // several tiles, ragged edges
    }
  }
  failures += cpu::check_rows_independent_of_m(GroupedLayout::kGmm, rng);
  failures += cpu::check_rows_independent_of_m(GroupedLayout::kGmmTransposed, rng);
  std::printf("%s\n", failures ? "FAIL" : "PASS");
  return failures ? 1 : 0;
}
