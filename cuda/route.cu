// CUDA route: one warp per token (up to 4 tokens per block).
//
// The warp keeps the token's E `source` scores and E `select` scores (plus the group
// scores) in shared memory:
//   1. Lanes own experts e = lane, lane + 32, ... and compute source / select exactly as
//      common/routing.h says (softmax max and sum by warp butterflies, expf, IEEE division;
//      NaN selection scores become -inf).
//   2. Group-limited: lanes score groups (sum of the two highest select values); then
//      topk_groups rounds of a warp-wide argmax over the group scores, each marking its
//      winner with NaN (NaN never wins); experts of unmarked groups get select = -inf.
//   3. Top-k: each lane keeps the best (score, index) among its own experts; k rounds of a
//      warp-wide argmax (higher score, then lower index: a strict total order, found by
//      two warp reductions, so every lane agrees) pick the experts in order. The winner's
//      owner marks it with NaN and rescans only its own experts.
//   4. The weight sum runs over j in order on every lane (identical on all lanes), then
//      lane j % 32 renormalizes and scales the weights it wrote.
// No atomics, no cross-warp communication: results are deterministic.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <climits>
#include <cmath>
#include <cstdint>

#include "common/routing.h"
#include "common/status.h"
#include "cuda/device.h"
#include "cuda/route_sources.cuh"
#include "cuda/routing.h"

namespace moe_xla {
namespace cuda {
namespace {

using route_detail::kFullMask;
using route_detail::kMaxWarpsPerBlock;
using route_detail::kWarp;
using route_detail::token_sources;

// The selection order: (a, ia) ranks before (b, ib). NaN never ranks before anything.
__device__ __forceinline__ bool ahead(float a, int ia, float b, int ib) {
  return a > b || (a == b && ia < ib);
}

// Best non-NaN entry among v[lane], v[lane + 32], ... of v[0, n); (-inf, INT_MAX) if none.
__device__ __forceinline__ void lane_best(const float* v, int n, int lane, float& bv, int& bi) {
  bv = -INFINITY;
  bi = INT_MAX;
  for (int e = lane; e < n; e += kWarp) {
    const float x = v[e];
    if (ahead(x, e, bv, bi)) {
      bv = x;
      bi = e;
    }
  }
}

// A 32-bit key of a non-NaN float that orders as the floats do: a > b exactly when
// key(a) > key(b). -0 takes +0's key (they compare equal).
__device__ __forceinline__ unsigned order_key(float v) {
  unsigned bits = __float_as_uint(v);
  if (bits == 0x80000000u) bits = 0u;
  return bits & 0x80000000u ? ~bits : bits | 0x80000000u;
}

// Index of the warp-wide best (score, index) in the order of ahead(); every lane gets the
// same result. Two warp reductions (sm_80's redux.sync): the highest key, then the lowest
// index among the lanes that hold it.
__device__ __forceinline__ int warp_best(float bv, int bi) {
  const unsigned key = order_key(bv);
  const unsigned best = __reduce_max_sync(kFullMask, key);
  return static_cast<int>(__reduce_min_sync(kFullMask, key == best ? static_cast<unsigned>(bi) : UINT_MAX));
}

struct RouteArgs {
  const void* logits;
  const float* bias;  // nullptr unless sigmoid with bias
  float* weights;
  int32_t* expert_ids;
  int64_t tokens;
  int experts;
  int top_k;
  int groups;       // 1 = no group limit
  int group_size;
  int keep_groups;
  int warp_floats;  // shared floats per warp
  bool softmax;
  bool renormalize;
  float scale;
};

template <typename T>
__global__ void __launch_bounds__(kWarp* kMaxWarpsPerBlock) route_kernel(RouteArgs a) {
  extern __shared__ float shared[];
  const int lane = threadIdx.x % kWarp;
  const int warp = threadIdx.x / kWarp;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * (blockDim.x / kWarp) + warp;
  if (t >= a.tokens) return;  // whole warps only; nothing below syncs the block
  const int E = a.experts;
  float* source = shared + static_cast<size_t>(warp) * a.warp_floats;
  float* select = source + E;
  float* group_score = select + E;
  const T* x = static_cast<const T*>(a.logits) + t * E;

  // 1. Scores.
  token_sources(x, E, lane, a.softmax, source);
  for (int e = lane; e < E; e += kWarp) {
    const float v = a.bias ? source[e] + a.bias[e] : source[e];
    select[e] = isnan(v) ? -INFINITY : v;
  }
  __syncwarp();

  // 2. Group limit.
  if (a.groups > 1) {
    const int gs = a.group_size;
    for (int g = lane; g < a.groups; g += kWarp) group_score[g] = moe_xla::group_score(select + g * gs, gs);
    __syncwarp();
    for (int r = 0; r < a.keep_groups; ++r) {
      float bv;
      int bi;
      lane_best(group_score, a.groups, lane, bv, bi);
      bi = warp_best(bv, bi);
      __syncwarp();
      if (lane == 0 && bi < a.groups) group_score[bi] = NAN;  // kept
      __syncwarp();
    }
    for (int e = lane; e < E; e += kWarp) {
      if (!isnan(group_score[e / gs])) select[e] = -INFINITY;
    }
    __syncwarp();
  }

  // 3. Top-k, 4. weights.
  const int k = a.top_k;
  float* w_out = a.weights + t * k;
  int32_t* id_out = a.expert_ids + t * k;
  float own_v;
  int own_i;
  lane_best(select, E, lane, own_v, own_i);
  float sum = 0.0f;
  for (int j = 0; j < k; ++j) {
    int bi = warp_best(own_v, own_i);
    if (bi >= E) bi = E - 1;  // unreachable for k <= E (an untaken expert is never NaN)
    const float w = source[bi];
    sum += w;
    if (lane == j % kWarp) {
      id_out[j] = bi;
      w_out[j] = w;
    }
    if (lane == bi % kWarp) {
      select[bi] = NAN;  // taken; only this lane reads its experts from here on
      lane_best(select, E, lane, own_v, own_i);
    }
  }
  for (int j = lane; j < k; j += kWarp) {
    float w = w_out[j];  // written by this lane above
    if (a.renormalize && sum > 0.0f) w = w / sum;
    w_out[j] = w * a.scale;
  }
}

}  // namespace

Status route(const RouteParams& p, cudaStream_t stream) {
  MOE_XLA_RETURN_IF_ERROR(require_device(DeviceSupport::kSimt, "route"));
  if (p.tokens < 0) return Status::InvalidArgument("route: negative number of tokens");
  if (p.experts < 1) return Status::InvalidArgument("route: expected at least one expert");
  if (p.experts > kRouteMaxExperts) {
    return Status::InvalidArgument("route: more than 4096 experts are not supported");
  }
  if (p.top_k < 1 || p.top_k > p.experts) {
    return Status::InvalidArgument("route: expected 1 <= top_k <= experts");
  }
  const int64_t groups = p.n_groups > 1 ? p.n_groups : 1;
  if (p.experts % groups != 0) {
    return Status::InvalidArgument("route: n_groups must divide the number of experts");
  }
  if (groups > 1 && (p.topk_groups < 1 || p.topk_groups > groups)) {
    return Status::InvalidArgument("route: expected 1 <= topk_groups <= n_groups");
  }
  if (p.score != Score::kSoftmax && p.score != Score::kSigmoid) {
    return Status::InvalidArgument("route: unknown score function");
  }
  if (p.tokens == 0) return Status();

  RouteArgs a;
  a.logits = p.logits;
  a.bias = p.score == Score::kSigmoid ? p.bias : nullptr;
  a.weights = p.weights;
  a.expert_ids = p.expert_ids;
  a.tokens = p.tokens;
  a.experts = static_cast<int>(p.experts);
  a.top_k = static_cast<int>(p.top_k);
  a.groups = static_cast<int>(groups);
  a.group_size = static_cast<int>(p.experts / groups);
  a.keep_groups = groups > 1 ? static_cast<int>(p.topk_groups) : 0;
  a.warp_floats = static_cast<int>(2 * p.experts + (groups > 1 ? groups : 0));
  a.softmax = p.score == Score::kSoftmax;
  a.renormalize = p.renormalize;
  a.scale = p.scale;

  return route_detail::launch_per_token("route", p.logits_dtype, p.tokens, a.warp_floats, a, &route_kernel<float>,
                                        &route_kernel<__nv_bfloat16>, &route_kernel<__half>, stream);
}

}  // namespace cuda
}  // namespace moe_xla
