// A route() test case and the tests' reference group scores, shared by the CPU test
// (tests/cc/cpu_routing_test.cc) and the CUDA self-test (tests/cc/routing_selftest.cu).
#ifndef MOE_XLA_TESTS_CC_ROUTE_CASE_H_
#define MOE_XLA_TESTS_CC_ROUTE_CASE_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <string>
#include <vector>

#include "common/routing.h"

namespace moe_xla {

struct RouteCase {
  int64_t T, E, k;
  DType dtype;
  Score score;
  bool bias;
  int64_t groups, keep;  // n_groups, topk_groups
  bool renormalize;
  float scale;
};

inline std::string describe(const RouteCase& c) {
  char buf[256];
  std::snprintf(buf, sizeof buf, "route T=%lld E=%lld k=%lld %s %s bias=%d groups=%lld/%lld renorm=%d scale=%g",
                (long long)c.T, (long long)c.E, (long long)c.k, dtype_name(c.dtype),
                c.score == Score::kSoftmax ? "softmax" : "sigmoid", c.bias, (long long)c.keep, (long long)c.groups,
                c.renormalize, c.scale);
  return buf;
}

// Group scores of one token's selection scores `select` [E] (NaN already -inf): per group of
// E / groups experts, the sum of its two largest scores (its one score for single-expert
// groups), NaN as -inf. Written by sorting, independently of common/routing.h's
// group_score, which it checks.
inline std::vector<float> reference_group_scores(const std::vector<float>& select, int64_t groups) {
  const int64_t size = static_cast<int64_t>(select.size()) / groups;
  std::vector<float> scores(groups);
  for (int64_t g = 0; g < groups; ++g) {
    std::vector<float> v(select.begin() + g * size, select.begin() + (g + 1) * size);
    std::sort(v.begin(), v.end(), [](float a, float b) { return a > b; });
    const float s = size == 1 ? v[0] : v[0] + v[1];
    scores[g] = std::isnan(s) ? -std::numeric_limits<float>::infinity() : s;
  }
  return scores;
}

}  // namespace moe_xla

#endif  // MOE_XLA_TESTS_CC_ROUTE_CASE_H_
