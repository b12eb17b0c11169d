// CUDA route_grad: one warp per token (up to 4 tokens per block).
//
// The warp computes the token's sources p into shared memory as route does
// (cuda/route_sources.cuh) and stages its ids there; lane 0 computes the picked w_j and
// the coefficients a_j and c of common/routing.h (route_grad_coefficients, in j order);
// each lane then writes d_logits[t, e] = -p[e] c + the a_j of the j with
// expert_ids[t, j] = e, in j order, for its experts e = lane, lane + 32, ... Ids outside
// [0, E) are never used as addresses. No atomics, no cross-warp communication: results
// are deterministic.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

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

__device__ __forceinline__ void store(float* p, float v) { *p = v; }
__device__ __forceinline__ void store(__nv_bfloat16* p, float v) { *p = __float2bfloat16_rn(v); }
__device__ __forceinline__ void store(__half* p, float v) { *p = __float2half_rn(v); }

struct RouteGradArgs {
  const void* logits;
  const int32_t* expert_ids;
  const float* d_weights;
  void* d_logits;
  int64_t tokens;
  int experts;
  int top_k;
  int warp_floats;  // shared 4-byte words per warp: E sources, k picked w_j (a_j in place), k ids
  Score score;
  bool renormalize;
  float scale;
};

template <typename T>
__global__ void __launch_bounds__(kWarp* kMaxWarpsPerBlock) route_grad_kernel(RouteGradArgs a) {
  extern __shared__ float shared[];
  const int lane = threadIdx.x % kWarp;
  const int warp = threadIdx.x / kWarp;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * (blockDim.x / kWarp) + warp;
  if (t >= a.tokens) return;  // whole warps only; nothing below syncs the block
  const int E = a.experts, k = a.top_k;
  float* source = shared + static_cast<size_t>(warp) * a.warp_floats;
  float* wa = source + E;
  int32_t* ids = reinterpret_cast<int32_t*>(wa + k);

  token_sources(static_cast<const T*>(a.logits) + t * E, E, lane, a.score == Score::kSoftmax, source);
  for (int j = lane; j < k; j += kWarp) ids[j] = a.expert_ids[t * k + j];
  __syncwarp();
  for (int j = lane; j < k; j += kWarp) {
    const int32_t e = ids[j];
    wa[j] = e >= 0 && e < E ? source[e] : 0.0f;
  }
  __syncwarp();
  float c = 0.0f;
  if (lane == 0) c = route_grad_coefficients(wa, a.d_weights + t * k, k, a.score, a.renormalize, a.scale, wa);
  c = __shfl_sync(kFullMask, c, 0);
  __syncwarp();

  T* out = static_cast<T*>(a.d_logits) + t * E;
  for (int e = lane; e < E; e += kWarp) {
    float d = -(source[e] * c);
    for (int j = 0; j < k; ++j) {
      if (ids[j] == e) d += wa[j];
    }
    store(out + e, d);
  }
}

}  // namespace

Status route_grad(const RouteGradParams& p, cudaStream_t stream) {
  MOE_XLA_RETURN_IF_ERROR(require_device(DeviceSupport::kSimt, "route_grad"));
  if (p.tokens < 0) return Status::InvalidArgument("route_grad: negative number of tokens");
  if (p.experts < 1 || p.experts > kRouteMaxExperts) {
    return Status::InvalidArgument("route_grad: expected 1 to 4096 experts");
  }
  if (p.top_k < 1 || p.top_k > kRouteMaxExperts) {
    return Status::InvalidArgument("route_grad: expected 1 <= top_k <= 4096");
  }
  if (p.score != Score::kSoftmax && p.score != Score::kSigmoid) {
    return Status::InvalidArgument("route_grad: unknown score function");
  }
  if (p.tokens == 0) return Status();

  RouteGradArgs a;
  a.logits = p.logits;
  a.expert_ids = p.expert_ids;
  a.d_weights = p.d_weights;
  a.d_logits = p.d_logits;
  a.tokens = p.tokens;
  a.experts = static_cast<int>(p.experts);
  a.top_k = static_cast<int>(p.top_k);
  a.warp_floats = static_cast<int>(p.experts + 2 * p.top_k);
  a.score = p.score;
  a.renormalize = p.renormalize;
  a.scale = p.scale;

  // E + 2k <= 12288 words for E, k <= 4096: at least one warp per CTA.
  return route_detail::launch_per_token("route_grad", p.logits_dtype, p.tokens, a.warp_floats, a,
                                        &route_grad_kernel<float>, &route_grad_kernel<__nv_bfloat16>,
                                        &route_grad_kernel<__half>, stream);
}

}  // namespace cuda
}  // namespace moe_xla
