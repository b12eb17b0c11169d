// CPU route_grad, one token at a time: the sources p as route computes them, the picked
// w_j, the coefficients of common/routing.h, then d_logits row by row.
#include "cpu/route_grad.h"

#include <cstdint>
#include <vector>

#include "cpu/dtype.h"
#include "cpu/route_sources.h"

namespace moe_xla::cpu {

void route_grad(const RouteGradParams& p) {
  const int64_t T = p.tokens, E = p.experts, k = p.top_k;
  if (T <= 0 || E <= 0 || k <= 0) return;
  const bool softmax = p.score == Score::kSoftmax;
  std::vector<float> source(E), w(k), a(k), d(E);
  for (int64_t t = 0; t < T; ++t) {
    const int64_t row = t * E;
    route_sources(p.logits, row, E, p.logits_dtype, softmax, source.data());
    const int32_t* ids = p.expert_ids + t * k;
    for (int64_t j = 0; j < k; ++j) w[j] = ids[j] >= 0 && ids[j] < E ? source[ids[j]] : 0.0f;
    const float c = route_grad_coefficients(w.data(), p.d_weights + t * k, k, p.score, p.renormalize, p.scale,
                                            a.data());
    for (int64_t e = 0; e < E; ++e) d[e] = -(source[e] * c);
    for (int64_t j = 0; j < k; ++j) {
      if (ids[j] >= 0 && ids[j] < E) d[ids[j]] += a[j];
    }
    for (int64_t e = 0; e < E; ++e) store_from_float(p.d_logits, row + e, p.logits_dtype, d[e]);
  }
}

}  // namespace moe_xla::cpu
