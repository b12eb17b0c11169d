// The CPU route / permute / unpermute kernels against direct, deliberately naive
// transcriptions of common/routing.h (k passes of argmax, group ranks by counting, slots by
// counting earlier assignments), plus a few hand-computed cases. Ids, slots and copied rows
// must match exactly; weights and sums too, since both sides do the same float operations
// in the same order. Exits non-zero on any failure.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "common/routing.h"
#include "cpu/dtype.h"
#include "cpu/permute.h"
#include "cpu/route.h"
#include "tests/cc/route_case.h"
#include "cpu/unpermute.h"

namespace moe_xla::cpu {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();
int failures = 0;

bool same_float(float a, float b) { return (std::isnan(a) && std::isnan(b)) || a == b; }

// ---------------------------------------------------------------------------------- route

void route_direct(const RouteParams& p) {
  const int64_t E = p.experts, k = p.top_k;
  const int64_t groups = p.n_groups, size = E / groups;
  for (int64_t t = 0; t < p.tokens; ++t) {
    std::vector<float> source(E), select(E);
    if (p.score == Score::kSoftmax) {
      float m = -kInf;
      for (int64_t e = 0; e < E; ++e) {
        const float x = load_as_float(p.logits, t * E + e, p.logits_dtype);
        if (x > m) m = x;
      }
      float sum = 0;
      for (int64_t e = 0; e < E; ++e) {
        source[e] = std::exp(load_as_float(p.logits, t * E + e, p.logits_dtype) - m);
        sum += source[e];
      }
      for (int64_t e = 0; e < E; ++e) source[e] /= sum;
      select = source;
    } else {
      for (int64_t e = 0; e < E; ++e) {
        source[e] = 1.0f / (1.0f + std::exp(-load_as_float(p.logits, t * E + e, p.logits_dtype)));
        select[e] = p.bias ? source[e] + p.bias[e] : source[e];
      }
    }
    for (float& v : select) v = std::isnan(v) ? -kInf : v;
    if (groups > 1) {
      const std::vector<float> score = reference_group_scores(select, groups);
      for (int64_t g = 0; g < groups; ++g) {
        int64_t ahead = 0;  // groups that rank before g
        for (int64_t h = 0; h < groups; ++h) {
          ahead += score[h] > score[g] || (score[h] == score[g] && h < g);
        }
        if (ahead >= p.topk_groups) {
          for (int64_t e = g * size; e < (g + 1) * size; ++e) select[e] = -kInf;
        }
      }
    }
    std::vector<char> taken(E, 0);
    float sum = 0;
    for (int64_t j = 0; j < k; ++j) {
      int64_t best = -1;
      for (int64_t e = 0; e < E; ++e) {
        if (!taken[e] && (best < 0 || select[e] > select[best])) best = e;
      }
      taken[best] = 1;
      p.expert_ids[t * k + j] = static_cast<int32_t>(best);
      p.weights[t * k + j] = source[best];
      sum += source[best];
    }
    for (int64_t j = 0; j < k; ++j) {
      float& w = p.weights[t * k + j];
      if (p.renormalize && sum > 0) w = w / sum;
      w = w * p.scale;
    }
  }
}

void check_route(const RouteCase& c, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.0f, 2.0f);
  std::uniform_int_distribution<int> kind(0, 9);
  std::vector<unsigned char> logits(c.T * c.E * dtype_bytes(c.dtype));
  for (int64_t t = 0; t < c.T; ++t) {
    const int k = kind(rng);
    for (int64_t e = 0; e < c.E; ++e) {
      float v = normal(rng);
      if (k == 0) v = std::round(v);                 // many exact ties
      if (k == 1 && e % 7 == 3) v = NAN;             // NaN row
      if (k == 2) v = -kInf;                         // all -inf
      if (k == 3 && e % 3 == 0) v = -kInf;           // some -inf
      if (k == 4) v = 0.5f;                          // all equal
      store_from_float(logits.data(), t * c.E + e, c.dtype, v);
    }
  }
  std::vector<float> bias(c.E);
  for (float& b : bias) b = 0.1f * normal(rng);
  std::vector<float> w(c.T * c.k, -1), w_ref(c.T * c.k, -2);
  std::vector<int32_t> ids(c.T * c.k, -1), ids_ref(c.T * c.k, -2);
  RouteParams p{logits.data(), c.dtype, c.bias ? bias.data() : nullptr, w.data(), ids.data(), c.T, c.E,
                c.k, c.score, c.groups, c.keep, c.renormalize, c.scale};
  route(p);
  RouteParams q = p;
  q.weights = w_ref.data();
  q.expert_ids = ids_ref.data();
  if (q.score == Score::kSoftmax) q.bias = nullptr;
  route_direct(q);
  int64_t bad = 0;
  for (int64_t i = 0; i < c.T * c.k; ++i) {
    if (ids[i] != ids_ref[i] || !same_float(w[i], w_ref[i])) {
      if (bad++ < 3) {
        std::printf("  [%lld] id %d vs %d, weight %.9g vs %.9g\n", (long long)i, ids[i], ids_ref[i], w[i],
                    w_ref[i]);
      }
    }
  }
  std::printf("%s %s\n", bad ? "FAIL" : "ok  ", describe(c).c_str());
  if (bad) ++failures;
}

void route_hand_cases() {
  auto run = [](std::vector<float> logits, std::vector<float> bias, int64_t E, int64_t k, Score score,
                int64_t groups, int64_t keep, float scale, std::vector<int32_t> want_ids,
                std::vector<float> want_w, const char* what) {
    const int64_t T = static_cast<int64_t>(logits.size()) / E;
    std::vector<float> w(T * k);
    std::vector<int32_t> ids(T * k);
    RouteParams p{logits.data(), DType::kF32, bias.empty() ? nullptr : bias.data(), w.data(), ids.data(), T,
                  E, k, score, groups, keep, true, scale};
    route(p);
    bool ok = ids == want_ids;
    for (size_t i = 0; i < w.size(); ++i) ok = ok && same_float(w[i], want_w[i]);
    std::printf("%s route hand case: %s\n", ok ? "ok  " : "FAIL", what);
    if (!ok) {
      ++failures;
      for (size_t i = 0; i < w.size(); ++i) std::printf("  id %d weight %.9g\n", ids[i], w[i]);
    }
  };
  run({1, 3, 3, 0}, {}, 4, 2, Score::kSoftmax, 1, 1, 1.0f, {1, 2}, {0.5f, 0.5f}, "tie goes to the lower index");
  run({NAN, 1, 2, 3}, {}, 4, 2, Score::kSoftmax, 1, 1, 1.0f, {0, 1}, {NAN, NAN}, "NaN row picks 0, 1");
  run({-kInf, -kInf, -kInf}, {}, 3, 3, Score::kSoftmax, 1, 1, 1.0f, {0, 1, 2}, {NAN, NAN, NAN}, "-inf row");
  run({0, 0, 0, NAN}, {0, 0, 0, 5}, 4, 4, Score::kSigmoid, 1, 1, 1.0f, {0, 1, 2, 3},
      {0.5f, 0.5f, 0.5f, NAN}, "sigmoid: a NaN logit ranks last; NaN sum skips renormalize");
  // sigmoid(0) = 0.5 everywhere, so select = 0.5 + bias:
  //   g0 {2.0, 0.0} -> 2.0, g1 {1.0, 1.0} -> 2.0, g2 {1.5, 0.25} -> 1.75, g3 {0.5, 0.5} -> 1.0
  const std::vector<float> bias = {1.5f, -0.5f, 0.5f, 0.5f, 1.0f, -0.25f, 0.0f, 0.0f};
  run(std::vector<float>(8, 0.0f), bias, 8, 2, Score::kSigmoid, 4, 2, 2.0f, {0, 2}, {1.0f, 1.0f},
      "group-limited: expert 4 (1.5) is in a dropped group");
  run(std::vector<float>(8, 0.0f), bias, 8, 2, Score::kSigmoid, 4, 1, 2.0f, {0, 1}, {1.0f, 1.0f},
      "group-limited: group tie goes to the lower group");
  run(std::vector<float>(8, 0.0f), bias, 8, 3, Score::kSigmoid, 1, 1, 3.0f, {0, 4, 2}, {1.0f, 1.0f, 1.0f},
      "no group limit");
}

// -------------------------------------------------------------------------------- permute

void check_permute(int64_t T, int64_t H, int64_t k, int64_t E, DType dtype, double invalid_fraction,
                   std::mt19937& rng) {
  const int64_t n = T * k;
  const size_t row = H * dtype_bytes(dtype);
  std::vector<unsigned char> x(T * row);
  for (auto& b : x) b = static_cast<unsigned char>(rng());
  std::uniform_int_distribution<int32_t> expert(0, static_cast<int32_t>(E - 1));
  std::uniform_real_distribution<double> u(0, 1);
  std::vector<int32_t> ids(n);
  for (auto& e : ids) {
    e = expert(rng);
    if (u(rng) < invalid_fraction) e = u(rng) < 0.5 ? -1 - expert(rng) : static_cast<int32_t>(E) + expert(rng);
    if (u(rng) < 0.01) e = u(rng) < 0.5 ? std::numeric_limits<int32_t>::min() : std::numeric_limits<int32_t>::max();
  }
  std::vector<unsigned char> xs(n * row, 0xAB);
  std::vector<int32_t> sizes(E, -7), row_map(n, -7), row_pairs(n, -7);
  PermuteParams p{x.data(), dtype, ids.data(), xs.data(), sizes.data(), row_map.data(), row_pairs.data(), T, H, k, E};
  permute(p);

  // Direct definition.
  auto valid = [&](int64_t i) { return ids[i] >= 0 && ids[i] < E; };
  std::vector<int64_t> want_sizes(E, 0);
  for (int64_t i = 0; i < n; ++i) {
    if (valid(i)) ++want_sizes[ids[i]];
  }
  int64_t bad = 0;
  for (int64_t e = 0; e < E; ++e) bad += sizes[e] != want_sizes[e];
  int64_t total = 0;
  for (int64_t s : want_sizes) total += s;
  std::vector<char> hit(n, 0);
  for (int64_t i = 0; i < n; ++i) {
    int64_t slot = 0;
    if (valid(i)) {
      for (int64_t e = 0; e < ids[i]; ++e) slot += want_sizes[e];
      for (int64_t i2 = 0; i2 < i; ++i2) slot += ids[i2] == ids[i];
    } else {
      slot = total;
      for (int64_t i2 = 0; i2 < i; ++i2) slot += !valid(i2);
    }
    if (row_map[i] != slot) {
      if (bad++ < 3) std::printf("  row_map[%lld] = %d, want %lld\n", (long long)i, row_map[i], (long long)slot);
      continue;
    }
    hit[slot] = 1;
    bad += row_pairs[slot] != i;
    if (row && std::memcmp(xs.data() + slot * row, x.data() + (i / k) * row, row) != 0) ++bad;
  }
  for (char h : hit) bad += !h;
  std::printf("%s permute T=%lld H=%lld k=%lld E=%lld %s invalid=%.2f\n", bad ? "FAIL" : "ok  ", (long long)T,
              (long long)H, (long long)k, (long long)E, dtype_name(dtype), invalid_fraction);
  if (bad) ++failures;
}

void permute_hand_case() {
  // i: 0:e1 1:e0 2:e1 3:invalid(5) 4:invalid(-1) 5:e0 -> sizes [2, 2, 0]
  std::vector<int32_t> ids = {1, 0, 1, 5, -1, 0};
  std::vector<float> x = {10, 20, 30}, xs(6, -1);
  std::vector<int32_t> sizes(3, -1), row_map(6, -1), row_pairs(6, -1);
  PermuteParams p{x.data(), DType::kF32, ids.data(), xs.data(), sizes.data(), row_map.data(), row_pairs.data(),
                  3, 1, 2, 3};
  permute(p);
  const bool ok = sizes == std::vector<int32_t>{2, 2, 0} && row_map == std::vector<int32_t>{2, 0, 3, 4, 5, 1} &&
                  row_pairs == std::vector<int32_t>{1, 5, 0, 2, 3, 4} &&
                  xs == std::vector<float>{10, 30, 10, 20, 20, 30};
  std::printf("%s permute hand case\n", ok ? "ok  " : "FAIL");
  if (!ok) ++failures;
}

// ------------------------------------------------------------------------------ unpermute

// y_sorted of R rows (R = T*k after permute, -1 here; any R in the EP layer).
void check_unpermute(int64_t T, int64_t H, int64_t k, DType dtype, std::mt19937& rng, int64_t R = -1) {
  const int64_t n = R < 0 ? T * k : R;
  std::normal_distribution<float> normal;
  std::vector<unsigned char> ys(n * H * dtype_bytes(dtype));
  for (int64_t i = 0; i < n * H; ++i) store_from_float(ys.data(), i, dtype, normal(rng));
  std::vector<float> w(T * k);
  for (float& v : w) v = normal(rng);
  std::uniform_int_distribution<int32_t> slot(-3, static_cast<int32_t>(std::max(n, T * k)) + 2);
  std::vector<int32_t> row_map(T * k);
  for (auto& r : row_map) r = slot(rng);
  if (T * k) row_map[0] = std::numeric_limits<int32_t>::min();
  std::vector<unsigned char> y(T * H * dtype_bytes(dtype), 0xCD);
  UnpermuteParams p{ys.data(), dtype, row_map.data(), w.data(), y.data(), T, H, k, n};
  unpermute(p);
  int64_t bad = 0;
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t h = 0; h < H; ++h) {
      float acc = 0.0f;
      for (int64_t j = 0; j < k; ++j) {
        const int32_t r = row_map[t * k + j];
        if (r >= 0 && r < n) acc = acc + w[t * k + j] * load_as_float(ys.data(), r * H + h, dtype);
      }
      std::vector<unsigned char> want(dtype_bytes(dtype));
      store_from_float(want.data(), 0, dtype, acc);
      bad += std::memcmp(want.data(), y.data() + (t * H + h) * dtype_bytes(dtype), dtype_bytes(dtype)) != 0;
    }
  }
  std::printf("%s unpermute T=%lld H=%lld k=%lld R=%lld %s\n", bad ? "FAIL" : "ok  ", (long long)T, (long long)H,
              (long long)k, (long long)n, dtype_name(dtype));
  if (bad) ++failures;
}

void unpermute_hand_case() {
  // Summation in j order: (0 + 1e8) + 1 = 1e8 in float, then - 1e8 = 0 (any other order
  // gives 1). Slots 8 and -1 are out of range [0, 8): they add nothing.
  std::vector<float> ys = {1e8f, 1.0f, -1e8f, 5.0f};
  std::vector<int32_t> row_map = {0, 1, 2, 8, -1, 3, 3, 3};
  std::vector<float> w = {1, 1, 1, 1, 2, 0.5f, 1, 1};
  std::vector<float> y(2, -1);
  UnpermuteParams p{ys.data(), DType::kF32, row_map.data(), w.data(), y.data(), 2, 1, 4, 8};
  unpermute(p);
  const bool ok = y[0] == 0.0f && y[1] == 12.5f;
  std::printf("%s unpermute hand case (j order, out-of-range slots): %g %g\n", ok ? "ok  " : "FAIL", y[0], y[1]);
  if (!ok) ++failures;
}

}  // namespace
}  // namespace moe_xla::cpu

int main() {
  using namespace moe_xla;
  using namespace moe_xla::cpu;
  std::mt19937 rng(1234);

  route_hand_cases();
  const DType dtypes[] = {DType::kF32, DType::kBF16, DType::kF16};
  for (DType d : dtypes) {
    check_route({0, 8, 2, d, Score::kSoftmax, false, 1, 1, true, 1.0f}, rng);
    check_route({50, 1, 1, d, Score::kSoftmax, false, 1, 1, true, 1.0f}, rng);
    check_route({50, 1, 1, d, Score::kSigmoid, true, 1, 1, false, 1.0f}, rng);
    check_route({300, 8, 2, d, Score::kSoftmax, false, 1, 1, true, 1.0f}, rng);
    check_route({300, 8, 8, d, Score::kSoftmax, false, 1, 1, false, 2.5f}, rng);
    check_route({200, 64, 1, d, Score::kSigmoid, true, 1, 1, true, 1.0f}, rng);
    check_route({200, 60, 6, d, Score::kSoftmax, false, 1, 1, true, 1.0f}, rng);
    check_route({100, 256, 8, d, Score::kSigmoid, true, 8, 4, true, 2.5f}, rng);
    check_route({100, 256, 8, d, Score::kSoftmax, false, 8, 3, false, 1.0f}, rng);
    check_route({100, 64, 8, d, Score::kSigmoid, true, 64, 8, true, 1.0f}, rng);   // groups of one
    check_route({100, 64, 64, d, Score::kSigmoid, true, 4, 4, true, 1.0f}, rng);   // k = E
    check_route({100, 60, 7, d, Score::kSigmoid, false, 30, 4, true, 1.0f}, rng);
    check_route({50, 512, 512, d, Score::kSoftmax, false, 1, 1, true, 1.0f}, rng);
    check_route({50, 512, 16, d, Score::kSigmoid, true, 16, 2, true, 1.0f}, rng);
  }

  permute_hand_case();
  for (DType d : dtypes) {
    check_permute(0, 16, 2, 8, d, 0.0, rng);
    check_permute(1, 1, 1, 1, d, 0.0, rng);
    check_permute(100, 7, 2, 8, d, 0.0, rng);
    check_permute(300, 33, 8, 64, d, 0.05, rng);
    check_permute(200, 5, 8, 8, d, 0.3, rng);   // k = E
    check_permute(64, 3, 4, 1, d, 0.5, rng);    // E = 1
    check_permute(500, 16, 6, 300, d, 0.01, rng);
    check_permute(40, 0, 3, 5, d, 0.2, rng);    // H = 0
    check_permute(20, 4, 2, 3, d, 1.0, rng);    // everything invalid
  }

  unpermute_hand_case();
  for (DType d : dtypes) {
    check_unpermute(0, 8, 2, d, rng);
    check_unpermute(1, 1, 1, d, rng);
    check_unpermute(100, 7, 2, d, rng);
    check_unpermute(300, 64, 8, d, rng);
    check_unpermute(50, 129, 3, d, rng);
    check_unpermute(30, 0, 2, d, rng);
    check_unpermute(100, 7, 2, d, rng, 37);    // fewer rows than T*k: the rest name none
    check_unpermute(50, 16, 3, d, rng, 400);   // a padded buffer: more rows than T*k
    check_unpermute(20, 8, 2, d, rng, 0);      // no rows at all
  }

  std::printf("%s: %d failure(s)\n", failures ? "FAILED" : "PASSED", failures);
  return failures ? 1 : 0;
}
