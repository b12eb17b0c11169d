// CUDA dispatch plan: grid-stride loops over tokens (and over the grouped rows for the
// fill), each item the contract's own per-token function.
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "common/ep_plan.h"
#include "common/status.h"
#include "cuda/device.h"
#include "cuda/ep_plan.h"

namespace moe_xla {
namespace cuda {
namespace {

constexpr int kThreads = 128;
constexpr int64_t kMaxBlocks = 4096;  // grid-stride beyond

unsigned blocks_for(int64_t items) {
  const int64_t blocks = (items + kThreads - 1) / kThreads;
  return static_cast<unsigned>(blocks < kMaxBlocks ? blocks : kMaxBlocks);
}

__global__ void dedup_rows(EpDedupRowsParams p) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; t < p.dims.tokens; t += stride) {
    ep_plan::dedup_token(p, t);
  }
}

__global__ void fill_places(EpRowPlacesParams p) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t rows = p.dims.tokens * p.dims.top_k;
  const int32_t none = static_cast<int32_t>(p.dims.tokens * p.dims.rows_per_token);
  for (int64_t r = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; r < rows; r += stride) {
    p.source[r] = none;
    p.pairs[r] = 0;
  }
}

__global__ void place_rows(EpRowPlacesParams p) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; t < p.dims.tokens; t += stride) {
    ep_plan::place_token(p, t);
  }
}

Status check(const EpPlanDims& d, const char* op) {
  if (d.tokens < 0 || d.top_k < 0 || d.mult < 0 || d.rows_per_token < 0) {
    return Status::InvalidArgument(std::string(op) + ": negative dimension");
  }
  return Status();
}

}  // namespace

Status ep_dedup_rows(const EpDedupRowsParams& p, cudaStream_t stream) {
  MOE_XLA_RETURN_IF_ERROR(require_device(DeviceSupport::kSimt, "ep_dedup_rows"));
  MOE_XLA_RETURN_IF_ERROR(check(p.dims, "ep_dedup_rows"));
  if (p.dims.tokens == 0) return Status();
  dedup_rows<<<blocks_for(p.dims.tokens), kThreads, 0, stream>>>(p);
  MOE_XLA_RETURN_IF_CUDA_ERROR(cudaGetLastError());
  return Status();
}

Status ep_row_places(const EpRowPlacesParams& p, cudaStream_t stream) {
  MOE_XLA_RETURN_IF_ERROR(require_device(DeviceSupport::kSimt, "ep_row_places"));
  MOE_XLA_RETURN_IF_ERROR(check(p.dims, "ep_row_places"));
  if (p.dims.tokens == 0) return Status();
  if (p.dims.top_k > 0) {
    fill_places<<<blocks_for(p.dims.tokens * p.dims.top_k), kThreads, 0, stream>>>(p);
    MOE_XLA_RETURN_IF_CUDA_ERROR(cudaGetLastError());
  }
  place_rows<<<blocks_for(p.dims.tokens), kThreads, 0, stream>>>(p);
  MOE_XLA_RETURN_IF_CUDA_ERROR(cudaGetLastError());
  return Status();
}

}  // namespace cuda
}  // namespace moe_xla
