// CPU routing, one token at a time: scores in float32, group filter, then a partial sort
// of the expert indices by (selection score descending, index ascending).
#include "cpu/route.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <vector>

#include "cpu/route_sources.h"

namespace moe_xla::cpu {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// The selection order: higher score first, the lower index on ties. Scores are never NaN
// here (NaN is replaced by -inf first), so this is a strict total order.
struct Ahead {
  const float* score;
  bool operator()(int32_t a, int32_t b) const {
    return score[a] > score[b] || (score[a] == score[b] && a < b);
  }
};

}  // namespace

void route(const RouteParams& p) {
  const int64_t T = p.tokens, E = p.experts, k = p.top_k;
  if (T <= 0 || E <= 0 || k <= 0) return;
  const int64_t groups = p.n_groups > 1 ? p.n_groups : 1;
  const int64_t group_size = E / groups;
  const int64_t keep_groups = std::min<int64_t>(std::max<int64_t>(p.topk_groups, 1), groups);
  const bool softmax = p.score == Score::kSoftmax;
  const float* bias = softmax ? nullptr : p.bias;

  std::vector<float> source(E), select(E), group_score(groups);
  std::vector<int32_t> order(E), group_order(groups);
  std::vector<char> group_kept(groups);

  for (int64_t t = 0; t < T; ++t) {
    const int64_t row = t * E;
    route_sources(p.logits, row, E, p.logits_dtype, softmax, source.data());
    for (int64_t e = 0; e < E; ++e) select[e] = bias ? source[e] + bias[e] : source[e];
    for (int64_t e = 0; e < E; ++e) {
      if (std::isnan(select[e])) select[e] = kNegInf;
    }

    if (groups > 1) {
      for (int64_t g = 0; g < groups; ++g) {
        group_score[g] = moe_xla::group_score(select.data() + g * group_size, group_size);
      }
      std::iota(group_order.begin(), group_order.end(), 0);
      std::partial_sort(group_order.begin(), group_order.begin() + keep_groups, group_order.end(),
                        Ahead{group_score.data()});
      std::fill(group_kept.begin(), group_kept.end(), 0);
      for (int64_t g = 0; g < keep_groups; ++g) group_kept[group_order[g]] = 1;
      for (int64_t e = 0; e < E; ++e) {
        if (!group_kept[e / group_size]) select[e] = kNegInf;
      }
    }

    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + k, order.end(), Ahead{select.data()});

    float* w = p.weights + t * k;
    int32_t* ids = p.expert_ids + t * k;
    float sum = 0.0f;
    for (int64_t j = 0; j < k; ++j) {
      ids[j] = order[j];
      w[j] = source[order[j]];
      sum += w[j];
    }
    for (int64_t j = 0; j < k; ++j) {
      float v = w[j];
      if (p.renormalize && sum > 0.0f) v = v / sum;
      w[j] = v * p.scale;
    }
  }
}

}  // namespace moe_xla::cpu
