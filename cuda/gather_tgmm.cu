// Dispatcher of the gather weight gradient: validation, device check, workspace layout and
// the prep kernel that turns the group sizes into the groups' rows and the order in which
// the kernel (gather_tgmm_kernel.cuh, one compilation per output dtype) walks them.
#include "cuda/gather_tgmm.h"

#include <cuda_runtime.h>

#include <cstdint>

#include "common/gather_tgmm.h"
#include "common/status.h"
#include "cuda/device.h"
#include "cuda/gather_checks.h"
#include "cuda/gather_dispatch.h"
#include "cuda/gather_tgmm_internal.h"
#include "cuda/group_offsets.cuh"

namespace moe_xla {
namespace cuda {
namespace {

using detail::align_up;
using detail::aligned16;
using detail::GatherTgmmGroupRows;
using detail::kAlign;
using detail::kGatherMaxDim;
using detail::kGatherTgmmStepRows;
using detail::kScanThreads;

// Size classes of size_class below: steps < 2^25 give classes below 100.
constexpr int kSizeClasses = 128;

// Offsets from an aligned base: groups' rows [G] | order [G].
struct WorkspaceLayout {
  size_t groups, order, total;
  explicit WorkspaceLayout(int64_t num_groups) {
    groups = 0;
    order = align_up(static_cast<size_t>(num_groups) * sizeof(GatherTgmmGroupRows));
    total = order + align_up(static_cast<size_t>(num_groups) * sizeof(int32_t));
  }
};

// A class of work-unit length for a group of `steps` steps of kGatherTgmmStepRows rows,
// non-decreasing in steps: the steps themselves below 8, then four classes per power of
// two (the three leading bits), so groups of one class differ by less than 25 %.
__device__ __forceinline__ int size_class(int64_t steps) {
  if (steps < 8) return static_cast<int>(steps);
  const int bits = 64 - __clzll(steps);  // steps in [2^(bits-1), 2^bits), bits >= 4
  return 4 * (bits - 3) + static_cast<int>(steps >> (bits - 3));
}

__device__ __forceinline__ int64_t group_steps(int64_t start, int64_t end) {
  return (end - start + kGatherTgmmStepRows - 1) / kGatherTgmmStepRows;
}

// One block of kScanThreads: every group's rows (scan_group_offsets of group_offsets.cuh,
// clamped as common/gather_tgmm.h says) and `order`, a permutation of the groups in
// decreasing size class, empty groups last. The order within a class follows shared-memory
// atomics and may differ between runs; it only decides which CTA computes a block, never
// how, so the output does not depend on it.
__global__ void __launch_bounds__(kScanThreads)
    gather_tgmm_groups_kernel(const int32_t* __restrict__ group_sizes, int64_t num_groups, int64_t m,
                              GatherTgmmGroupRows* __restrict__ groups, int32_t* __restrict__ order) {
  __shared__ int32_t cursor[kSizeClasses];  // groups per class, then the next free place
  for (int c = threadIdx.x; c < kSizeClasses; c += blockDim.x) cursor[c] = 0;
  __syncthreads();
  detail::scan_group_offsets(group_sizes, num_groups, m, nullptr, [&](int64_t g, int64_t start, int64_t end) {
    groups[g] = GatherTgmmGroupRows{static_cast<int32_t>(start), static_cast<int32_t>(end)};
    atomicAdd(&cursor[size_class(group_steps(start, end))], 1);
  });
  __syncthreads();  // the counts are complete, and groups[] is visible to the whole block
  if (threadIdx.x == 0) {
    int32_t first = 0;  // larger classes first
    for (int c = kSizeClasses - 1; c >= 0; --c) {
      const int32_t count = cursor[c];
      cursor[c] = first;
      first += count;
    }
  }
  __syncthreads();
  for (int64_t g = threadIdx.x; g < num_groups; g += blockDim.x) {
    const GatherTgmmGroupRows rows = groups[g];
    order[atomicAdd(&cursor[size_class(group_steps(rows.start, rows.end))], 1)] = static_cast<int32_t>(g);
  }
}

// The compiled kernels, one per output dtype of the instance table in cuda/BUILD.bazel.
using KernelInstance = detail::OutDtypeInstance<detail::GatherTgmmLaunch>;

#define MOE_XLA_CUTLASS_INSTANCE(OUT_DTYPE) \
  KernelInstance{DType::OUT_DTYPE, &detail::gather_tgmm_kernel_run<DType::OUT_DTYPE>},

constexpr KernelInstance kKernelInstances[] = {
// One MOE_XLA_CUTLASS_INSTANCE(out dtype) line per entry of the table, written by the
// build (cutlass_instances in bazel/cuda.bzl).
#include "cuda/gather_tgmm_kernels.inc"
};
#undef MOE_XLA_CUTLASS_INSTANCE

// Shape and dtype errors that need no device: ok or an InvalidArgument naming the field.
// (Both output dtypes of the checks have an instance.)
Status validate(const GatherTgmmParams& p) {
  return detail::validate_gather("gather_tgmm", "x and dy", p.in_dtype, p.out_dtype,
                                 {p.tokens, p.m, p.k, p.n, p.num_groups}, "x and out", "dy and out");
}

}  // namespace

size_t gather_tgmm_workspace_bytes(int64_t num_groups) {
  if (num_groups < 0 || num_groups > kGatherMaxDim) return 0;
  return kAlign /* slack to align the base */ + WorkspaceLayout(num_groups).total;
}

size_t gather_tgmm_workspace_bytes(const GatherTgmmParams& p) {
  if (!validate(p).ok()) return 0;
  return gather_tgmm_workspace_bytes(p.num_groups);
}

Status gather_tgmm(const GatherTgmmParams& p, void* workspace, size_t workspace_bytes,
                   cudaStream_t stream) {
  MOE_XLA_RETURN_IF_ERROR(validate(p));
  if (p.num_groups == 0 || p.k == 0 || p.n == 0) return Status();  // nothing to write
  if (p.out == nullptr) return Status::InvalidArgument("gather_tgmm: null output pointer");
  if (!aligned16(p.out)) return Status::InvalidArgument("gather_tgmm: out is not 16-byte aligned");
  // Every group is empty when there are no rows.
  if (p.m == 0) {
    MOE_XLA_RETURN_IF_CUDA_ERROR(cudaMemsetAsync(
        p.out, 0, static_cast<size_t>(p.num_groups * p.k * p.n) * dtype_bytes(p.out_dtype), stream));
    return Status();
  }
  if (p.dy == nullptr || p.src == nullptr || p.group_sizes == nullptr || (p.tokens > 0 && p.x == nullptr)) {
    return Status::InvalidArgument("gather_tgmm: null x, dy, src or group_sizes pointer");
  }
  if (!aligned16(p.x) || !aligned16(p.dy)) {
    return Status::InvalidArgument("gather_tgmm: x and dy must be 16-byte aligned");
  }
  MOE_XLA_RETURN_IF_ERROR(require_device(DeviceSupport::kFull, "gather_tgmm"));
  int sm_count = 0;
  MOE_XLA_RETURN_IF_ERROR(current_device_sm_count(&sm_count));
  const size_t needed = gather_tgmm_workspace_bytes(p);
  MOE_XLA_RETURN_IF_ERROR(
      detail::check_workspace("gather_tgmm", workspace, workspace_bytes, needed));

  char* base = detail::aligned_base(workspace);
  const WorkspaceLayout layout(p.num_groups);
  auto* groups = reinterpret_cast<GatherTgmmGroupRows*>(base + layout.groups);
  auto* order = reinterpret_cast<int32_t*>(base + layout.order);

  gather_tgmm_groups_kernel<<<1, kScanThreads, 0, stream>>>(p.group_sizes, p.num_groups, p.m, groups, order);
  MOE_XLA_RETURN_IF_CUDA_ERROR(cudaGetLastError());  // launch of the group scan

  const detail::GatherTgmmLaunch launch{&p, groups, order, sm_count, stream};
  return detail::find_instance(kKernelInstances, p.out_dtype)->run(launch).With("gather_tgmm");
}

}  // namespace cuda
}  // namespace moe_xla
