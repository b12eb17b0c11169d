// The per-token sources of route and route_grad on the host (common/routing.h): softmax
// (max-subtracted) or sigmoid of one row of logits, in float32.
#ifndef MOE_XLA_CPU_ROUTE_SOURCES_H_
#define MOE_XLA_CPU_ROUTE_SOURCES_H_

#include <cmath>
#include <cstdint>
#include <limits>

#include "common/grouped_gemm.h"  // DType
#include "cpu/dtype.h"

namespace moe_xla::cpu {

// source[0, E) from logits[row, row + E) of `dtype`.
inline void route_sources(const void* logits, int64_t row, int64_t E, DType dtype, bool softmax, float* source) {
  if (softmax) {
    // Max ignoring NaN: a NaN anywhere makes the sum, hence every p, NaN anyway.
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t e = 0; e < E; ++e) {
      source[e] = load_as_float(logits, row + e, dtype);
      m = std::fmax(m, source[e]);
    }
    float sum = 0.0f;
    for (int64_t e = 0; e < E; ++e) {
      source[e] = std::exp(source[e] - m);
      sum += source[e];
    }
    for (int64_t e = 0; e < E; ++e) source[e] = source[e] / sum;
  } else {
    for (int64_t e = 0; e < E; ++e) source[e] = 1.0f / (1.0f + std::exp(-load_as_float(logits, row + e, dtype)));
  }
}

}  // namespace moe_xla::cpu

#endif  // MOE_XLA_CPU_ROUTE_SOURCES_H_
