// The warp-per-token pieces shared by the CUDA route and route_grad kernels: a token's
// sources p (common/routing.h) computed by one warp into shared memory, the warp
// reductions they use, and their launch.
#ifndef MOE_XLA_CUDA_ROUTE_SOURCES_CUH_
#define MOE_XLA_CUDA_ROUTE_SOURCES_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <climits>
#include <cstddef>
#include <cstdint>
#include <string>

#include "common/grouped_gemm.h"  // DType
#include "common/status.h"

namespace moe_xla {
namespace cuda {
namespace route_detail {

constexpr int kWarp = 32;
constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kMaxWarpsPerBlock = 4;
constexpr size_t kMaxSharedBytes = 48 * 1024;  // default dynamic shared memory limit

__device__ __forceinline__ float to_f32(float v) { return v; }
__device__ __forceinline__ float to_f32(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_f32(__half v) { return __half2float(v); }

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int offset = kWarp / 2; offset > 0; offset /= 2) v = fmaxf(v, __shfl_xor_sync(kFullMask, v, offset));
  return v;
}

// Xor butterfly: every lane adds the same pairs (a + b == b + a), so all lanes agree.
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = kWarp / 2; offset > 0; offset /= 2) v += __shfl_xor_sync(kFullMask, v, offset);
  return v;
}

// source[e] for the lane's experts e = lane, lane + 32, ... of the token's logits x [E]:
// softmax (max-subtracted; max and sum by warp butterflies, expf, IEEE division) or
// sigmoid. The lane reads back only the entries it wrote.
template <typename T>
__device__ __forceinline__ void token_sources(const T* x, int E, int lane, bool softmax, float* source) {
  if (softmax) {
    float m = -INFINITY;  // max ignoring NaN (a NaN makes every p NaN through the sum anyway)
    for (int e = lane; e < E; e += kWarp) {
      const float v = to_f32(x[e]);
      source[e] = v;
      m = fmaxf(m, v);
    }
    m = warp_max(m);
    float sum = 0.0f;
    for (int e = lane; e < E; e += kWarp) {
      const float v = expf(source[e] - m);
      source[e] = v;
      sum += v;
    }
    sum = warp_sum(sum);
    for (int e = lane; e < E; e += kWarp) source[e] = source[e] / sum;
  } else {
    for (int e = lane; e < E; e += kWarp) source[e] = 1.0f / (1.0f + expf(-to_f32(x[e])));
  }
}

// Launches the kernel of `dtype` (f32, bf16 or f16 logits) on args with one warp per
// token, as many warps per CTA (up to 4) as 48 KB of shared memory holds at warp_words
// 4-byte words each.
template <typename Args>
Status launch_per_token(const char* op, DType dtype, int64_t tokens, int64_t warp_words, const Args& args,
                        void (*f32)(Args), void (*bf16)(Args), void (*f16)(Args), cudaStream_t stream) {
  const size_t warp_bytes = 4 * static_cast<size_t>(warp_words);
  int warps = static_cast<int>(kMaxSharedBytes / warp_bytes);
  if (warps > kMaxWarpsPerBlock) warps = kMaxWarpsPerBlock;
  if (warps < 1) return Status::InvalidArgument(std::string(op) + ": too many experts for shared memory");
  const int64_t blocks = (tokens + warps - 1) / warps;
  if (blocks > INT_MAX) return Status::InvalidArgument(std::string(op) + ": too many tokens");
  void (*kernel)(Args) = dtype == DType::kF32 ? f32 : dtype == DType::kBF16 ? bf16 : dtype == DType::kF16 ? f16 : nullptr;
  if (kernel == nullptr) return Status::InvalidArgument(std::string(op) + ": unsupported logits dtype");
  kernel<<<static_cast<unsigned>(blocks), kWarp * warps, warp_bytes * warps, stream>>>(args);
  MOE_XLA_RETURN_IF_CUDA_ERROR(cudaGetLastError());  // launch of the kernel
  return Status();
}

}  // namespace route_detail
}  // namespace cuda
}  // namespace moe_xla

#endif  // MOE_XLA_CUDA_ROUTE_SOURCES_CUH_
