// A route() test case, shared by the CPU test (cpu/routing_test.cc) and the CUDA
// self-test (cuda/routing_selftest.cu) so both describe their cases alike.
#ifndef MOE_XLA_CPU_ROUTE_CASE_H_
#define MOE_XLA_CPU_ROUTE_CASE_H_

#include <cstdint>
#include <cstdio>
#include <string>

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

}  // namespace moe_xla

#endif  // MOE_XLA_CPU_ROUTE_CASE_H_
