// Framework-free contracts of the routing, dispatch and combine ops of a dropless MoE
// layer, shared by the CPU kernels (cpu/) and the CUDA kernels (cuda/).
//
// route: logits [T, E] -> weights [T, k] f32, expert_ids [T, k] int32
//   x = float(logits[t]).
//   softmax: p = softmax(x) (max-subtracted);  select = p;         source = p
//   sigmoid: s = 1 / (1 + exp(-x));            select = s + bias;  source = s
//   NaN in `select` counts as -inf. Group-limited (n_groups > 1): the E experts form
//   n_groups consecutive groups of E / n_groups; a group's score is the sum of its two
//   highest `select` values (its one value if a group has one expert); the topk_groups
//   best groups are kept (ties: lower group index) and experts outside them count as -inf.
//   The k experts with the highest `select` are picked, in descending order, ties going
//   to the lower expert index: expert_ids is always in [0, E), also for NaN or -inf rows.
//   weights[t, j] = source[expert_ids[t, j]], divided by their sum over j when
//   renormalize (if that sum is > 0), then times scale.
//
// route_grad: logits [T, E], expert_ids [T, k], d_weights [T, k] f32 -> d_logits [T, E]
//   The vector-Jacobian product of route's weights in logits for fixed expert_ids (the
//   transpose of their JVP). Per token, in float32, with p = source as in route and
//   w_j = p[expert_ids[t, j]] (0 for an id outside [0, E), which contributes nothing):
//     g_j = scale * d_weights[t, j]
//     renormalize, S = sum_j w_j > 0:  v_j = w_j / S,  r = sum_m v_m g_m,  b_j = v_j (g_j - r)
//     otherwise:                       b_j = w_j g_j
//     softmax: a_j = b_j,  c = sum_j a_j
//     sigmoid: a_j = (1 - w_j) b_j,  c = 0
//     d_logits[t, e] = (sum_{j : expert_ids[t, j] = e} a_j) - p[e] * c
//   (b_j = w_j u_j with u = the renormalisation's transpose applied to g, u_j = g_j / S - r / S,
//   formed without S * S, which underflows for the tiny S of very negative sigmoid logits.)
//   Sums run over j in order; a_j is added to its expert in j order after -p[e] * c. The
//   order is fixed; where a compiler contracts a multiply and an add into one fused
//   multiply-add (nvcc does), platforms may differ in the last bit. d_logits has the dtype
//   of logits.
//
// permute: x [T, H], expert_ids [T, k], E
//   -> x_sorted [T*k, H], group_sizes [E], row_map [T*k], row_pairs [T*k]
//   Assignment i = t*k + j goes to expert e = expert_ids[t, j]; valid if 0 <= e < E.
//   group_sizes[e] = number of valid assignments to e. A stable counting sort:
//     slot(i) = sum_{e' < e} group_sizes[e'] + #{i' < i : expert(i') == e}       (valid)
//     slot(i) = sum_e group_sizes[e] + #{i' < i : i' invalid}                    (invalid)
//   row_map[i] = slot(i); x_sorted[slot(i)] = x[t]. Invalid assignments land past every
//   group, where gmm writes zeros, so they contribute nothing. row_pairs is the inverse
//   permutation, row_pairs[slot(i)] = i: the assignment t*k + j each sorted row holds.
//
// unpermute: y_sorted [R, H], row_map [T*k], weights [T, k] -> y [T, H]
//   y[t] = sum_{j = 0..k-1} weights[t, j] * y_sorted[row_map[t*k + j]], summed in j order
//   in float32 (each term rounded, then added: no fused multiply-add), then cast to the
//   dtype of y_sorted. A row_map entry outside [0, R) contributes 0 (never an out-of-bounds
//   read). R is any row count: T*k after permute, a padded buffer's rows in the EP layer.
//   Without weights (a null pointer) every weight is 1: y[t] is the sum of its rows, the
//   same bits as with weights of 1 (1 * v is exact).
#ifndef MOE_XLA_COMMON_ROUTING_H_
#define MOE_XLA_COMMON_ROUTING_H_

#include <cstdint>

#include "common/grouped_gemm.h"  // DType

namespace moe_xla {

enum class Score : int32_t { kSoftmax = 0, kSigmoid = 1 };

// Score of one expert group for group-limited routing: the sum of its two highest
// selection values (its one value for a group of one); NaN (inf + -inf) counts as -inf.
MOE_XLA_HOST_DEVICE inline float group_score(const float* select, int64_t size) {
  const float neg_inf = -__builtin_huge_valf();
  float best = neg_inf, second = neg_inf;
  for (int64_t e = 0; e < size; ++e) {
    const float v = select[e];
    if (v > best) {
      second = best;
      best = v;
    } else if (v > second) {
      second = v;
    }
  }
  const float s = size == 1 ? best : best + second;
  return s != s ? neg_inf : s;
}

struct RouteParams {
  const void* logits;      // [T, E], logits_dtype
  DType logits_dtype;
  const float* bias;       // [E] or nullptr; only used with kSigmoid
  float* weights;          // [T, k]
  int32_t* expert_ids;     // [T, k]
  int64_t tokens;          // T
  int64_t experts;         // E
  int64_t top_k;           // 1 <= k <= E
  Score score;
  int64_t n_groups;        // 1 = no group limit; divides E
  int64_t topk_groups;     // 1 <= topk_groups <= n_groups; topk_groups * E / n_groups >= k
  bool renormalize;
  float scale;
};

struct RouteGradParams {
  const void* logits;        // [T, E], logits_dtype
  DType logits_dtype;
  const int32_t* expert_ids;  // [T, k]
  const float* d_weights;    // [T, k]
  void* d_logits;            // [T, E], logits_dtype
  int64_t tokens;            // T
  int64_t experts;           // E
  int64_t top_k;             // k >= 1
  Score score;
  bool renormalize;
  float scale;
};

// route_grad's per-token coefficients from the picked sources w[0, k) (0 for invalid ids)
// and the cotangent d_weights row g[0, k): a[j] as the contract says; returns c. a may be
// w itself (each a[j] is written after the last read of w[j]).
MOE_XLA_HOST_DEVICE inline float route_grad_coefficients(const float* w, const float* g, int64_t k, Score score,
                                                         bool renormalize, float scale, float* a) {
  float total = 0.0f;
  for (int64_t j = 0; j < k; ++j) total += w[j];
  const bool divide = renormalize && total > 0.0f;
  float r = 0.0f;
  if (divide) {
    for (int64_t j = 0; j < k; ++j) r += (w[j] / total) * (scale * g[j]);
  }
  float c = 0.0f;
  for (int64_t j = 0; j < k; ++j) {
    const float gj = scale * g[j];
    const float b = divide ? (w[j] / total) * (gj - r) : w[j] * gj;
    a[j] = score == Score::kSoftmax ? b : (1.0f - w[j]) * b;
    c += a[j];
  }
  return score == Score::kSoftmax ? c : 0.0f;
}

struct PermuteParams {
  const void* x;           // [T, H], dtype
  DType dtype;
  const int32_t* expert_ids;  // [T, k]
  void* x_sorted;          // [T*k, H], dtype
  int32_t* group_sizes;    // [E]
  int32_t* row_map;        // [T*k]
  int32_t* row_pairs;      // [T*k]
  int64_t tokens;          // T
  int64_t hidden;          // H
  int64_t top_k;           // k
  int64_t experts;         // E
};

struct UnpermuteParams {
  const void* y_sorted;    // [R, H], dtype
  DType dtype;
  const int32_t* row_map;  // [T*k]
  const float* weights;    // [T, k], or null: every weight 1
  void* y;                 // [T, H], dtype
  int64_t tokens;
  int64_t hidden;
  int64_t top_k;
  int64_t rows;            // R, rows of y_sorted
};

}  // namespace moe_xla

#endif  // MOE_XLA_COMMON_ROUTING_H_
