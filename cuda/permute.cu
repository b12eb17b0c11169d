// CUDA permute (dispatch): a stable sort of the T*k assignments by expert.
//
//   1. make_keys: key[i] = expert_ids[i] if it lies in [0, E), else E (invalid ids sort
//      after every group); value[i] = i.
//   2. cub::DeviceRadixSort::SortPairs over the low ceil(log2(E + 1)) bits of the keys.
//      LSD radix sort is stable, so equal keys keep assignment order: sorted position s
//      is exactly slot(i) of common/routing.h.
//   3. group_sizes: one thread per expert, two binary searches on the sorted keys
//      (upper minus lower bound). No atomics, no memset.
//   4. row_map[sorted_value[s]] = s and row_pairs[s] = sorted_value[s], one thread per
//      slot (the sorted values are a permutation of [0, T*k), so every entry of both is
//      written once);
//   5. the row expansion of cuda/row_gather.cuh: token t's row is read once and stored
//      into its k slots x_sorted[row_map[t * k + j]], with the widest copy unit (16, 8, 4,
//      2 or 1 bytes) that the row size and both pointers allow.
// The workspace holds the two key and two value buffers of the sort plus CUB's temporary
// storage; its size comes from CUB's host-only size query.
#include <cuda_runtime.h>

#include <climits>
#include <cstdint>
#include <cub/cub.cuh>
#include <string>

#include "common/routing.h"
#include "common/status.h"
#include "cuda/device.h"
#include "cuda/routing.h"
#include "cuda/row_gather.cuh"

namespace moe_xla {
namespace cuda {
namespace {

constexpr size_t kAlign = 256;
constexpr int kThreads = 256;

size_t align_up(size_t x) { return (x + kAlign - 1) / kAlign * kAlign; }

// Bits that hold every key in [0, E].
int key_bits(int64_t experts) {
  int bits = 1;
  while (bits < 32 && (int64_t{1} << bits) <= experts) ++bits;
  return bits;
}

struct Layout {
  size_t keys[2], values[2], temp, temp_bytes, total;
};

// Offsets from an aligned base; `total` includes slack to align any workspace pointer.
cudaError_t make_layout(const PermuteParams& p, Layout& l) {
  const int n = static_cast<int>(p.tokens * p.top_k);
  cub::DoubleBuffer<uint32_t> keys(nullptr, nullptr);
  cub::DoubleBuffer<int32_t> values(nullptr, nullptr);
  l.temp_bytes = 0;
  const cudaError_t err =
      cub::DeviceRadixSort::SortPairs(nullptr, l.temp_bytes, keys, values, n, 0, key_bits(p.experts));
  const size_t array = align_up(static_cast<size_t>(n) * 4);
  l.keys[0] = 0;
  l.keys[1] = array;
  l.values[0] = 2 * array;
  l.values[1] = 3 * array;
  l.temp = 4 * array;
  l.total = l.temp + align_up(l.temp_bytes) + kAlign;
  return err;
}

Status check(const PermuteParams& p) {
  if (p.tokens < 0 || p.top_k < 0 || p.hidden < 0 || p.experts < 0) {
    return Status::InvalidArgument("permute: negative dimension");
  }
  if (p.tokens * p.top_k > INT_MAX) return Status::InvalidArgument("permute: T * k must fit in int32");
  if (p.experts >= INT_MAX) return Status::InvalidArgument("permute: too many experts");
  if (p.dtype != DType::kF32 && p.dtype != DType::kBF16 && p.dtype != DType::kF16) {
    return Status::InvalidArgument("permute: unsupported dtype");
  }
  return Status();
}

__global__ void make_keys(const int32_t* __restrict__ ids, int n, int experts, uint32_t* __restrict__ keys,
                          int32_t* __restrict__ values) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const int32_t e = ids[i];
    keys[i] = e >= 0 && e < experts ? static_cast<uint32_t>(e) : static_cast<uint32_t>(experts);
    values[i] = static_cast<int32_t>(i);
  }
}

// First position in sorted[0, n) whose key is >= key.
__device__ __forceinline__ int lower_bound(const uint32_t* sorted, int n, uint32_t key) {
  int lo = 0, hi = n;
  while (lo < hi) {
    const int mid = lo + (hi - lo) / 2;
    if (sorted[mid] < key) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  return lo;
}

__global__ void count_groups(const uint32_t* __restrict__ sorted, int n, int experts,
                             int32_t* __restrict__ group_sizes) {
  const int e = blockIdx.x * blockDim.x + threadIdx.x;
  if (e >= experts) return;
  group_sizes[e] = lower_bound(sorted, n, e + 1u) - lower_bound(sorted, n, static_cast<uint32_t>(e));
}

__global__ void invert(const int32_t* __restrict__ order, int n, int32_t* __restrict__ row_map,
                       int32_t* __restrict__ row_pairs) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t s = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; s < n; s += stride) {
    const int32_t i = order[s];
    row_pairs[s] = i;
    if (i >= 0 && i < n) row_map[i] = static_cast<int32_t>(s);  // always: the sort's values are a permutation
  }
}

}  // namespace

size_t permute_workspace_bytes(const PermuteParams& p) {
  if (!check(p).ok()) return 0;
  Layout l;
  if (make_layout(p, l) != cudaSuccess) return 0;  // permute() reports the error
  return l.total;
}

Status permute(const PermuteParams& p, void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  MOE_XLA_RETURN_IF_ERROR(require_device(DeviceSupport::kSimt, "permute"));
  MOE_XLA_RETURN_IF_ERROR(check(p));
  const int n = static_cast<int>(p.tokens * p.top_k);
  const int experts = static_cast<int>(p.experts);
  if (n == 0) {
    if (experts > 0) {
      MOE_XLA_RETURN_IF_CUDA_ERROR(cudaMemsetAsync(p.group_sizes, 0, sizeof(int32_t) * experts, stream));
    }
    return Status();
  }
  Layout l;
  MOE_XLA_RETURN_IF_CUDA_ERROR(make_layout(p, l));
  if (workspace == nullptr || workspace_bytes < l.total) {
    return Status::InvalidArgument("permute: workspace of " + std::to_string(workspace_bytes) +
                                   " bytes, the sort needs " + std::to_string(l.total));
  }
  const uintptr_t raw = reinterpret_cast<uintptr_t>(workspace);
  char* base = reinterpret_cast<char*>((raw + kAlign - 1) / kAlign * kAlign);
  cub::DoubleBuffer<uint32_t> keys(reinterpret_cast<uint32_t*>(base + l.keys[0]),
                                   reinterpret_cast<uint32_t*>(base + l.keys[1]));
  cub::DoubleBuffer<int32_t> values(reinterpret_cast<int32_t*>(base + l.values[0]),
                                    reinterpret_cast<int32_t*>(base + l.values[1]));

  int key_blocks = (n + kThreads - 1) / kThreads;
  if (key_blocks > 4096) key_blocks = 4096;  // grid-stride beyond
  make_keys<<<key_blocks, kThreads, 0, stream>>>(p.expert_ids, n, experts, keys.Current(), values.Current());
  MOE_XLA_RETURN_IF_CUDA_ERROR(cudaGetLastError());  // launch of make_keys

  size_t temp_bytes = l.temp_bytes;
  MOE_XLA_RETURN_IF_CUDA_ERROR(cub::DeviceRadixSort::SortPairs(
      base + l.temp, temp_bytes, keys, values, n, 0, key_bits(p.experts), stream));

  if (experts > 0) {
    count_groups<<<(experts + kThreads - 1) / kThreads, kThreads, 0, stream>>>(keys.Current(), n, experts,
                                                                               p.group_sizes);
    MOE_XLA_RETURN_IF_CUDA_ERROR(cudaGetLastError());  // launch of count_groups
  }

  invert<<<key_blocks, kThreads, 0, stream>>>(values.Current(), n, p.row_map, p.row_pairs);
  MOE_XLA_RETURN_IF_CUDA_ERROR(cudaGetLastError());  // launch of invert

  const int64_t row_bytes = p.hidden * static_cast<int64_t>(dtype_bytes(p.dtype));
  MOE_XLA_RETURN_IF_CUDA_ERROR(row_gather::launch_expand(p.x, p.x_sorted, p.tokens, static_cast<int>(p.top_k), n,
                                                         row_bytes, p.row_map, stream));
  return Status();
}

}  // namespace cuda
}  // namespace moe_xla
