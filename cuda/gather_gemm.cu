// Dispatcher of the gather grouped GEMM: validation, device check, workspace, and the
// table of row tiles (cuda/row_tiles.h) that the GEMM kernel (gather_gemm_kernel.cuh, one
// compilation per output dtype, layout of w and epilogue) walks.
#include "cuda/gather_gemm.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "common/expert_activation.h"
#include "common/gather_gemm.h"
#include "common/status.h"
#include "cuda/device.h"
#include "cuda/gather_checks.h"
#include "cuda/gather_dispatch.h"
#include "cuda/gather_gemm_internal.h"
#include "cuda/row_tiles.h"

namespace moe_xla {
namespace cuda {
namespace {

using detail::aligned16;
using detail::GatherEpilogue;
using detail::kAlign;
using detail::kGatherMaxDim;
using detail::kGatherTileM;

// One compiled kernel: its output dtype, the layout of w (kGmm: [G, K, N];
// kGmmTransposed: [G, N, K]), its epilogue and its launcher.
struct KernelInstance {
  DType out_dtype;
  GroupedLayout layout;
  GatherEpilogue epilogue;
  Status (*run)(const detail::GatherGemmLaunch& launch);
};

#define MOE_XLA_CUTLASS_INSTANCE(OUT_DTYPE, LAYOUT, EPILOGUE)                         \
  KernelInstance{DType::OUT_DTYPE, GroupedLayout::LAYOUT, GatherEpilogue::EPILOGUE,   \
                 &detail::gather_gemm_kernel_run<DType::OUT_DTYPE, GroupedLayout::LAYOUT, \
                                                 GatherEpilogue::EPILOGUE>},

// The compiled kernels, one per (output dtype, layout, epilogue) of the instance table in
// cuda/BUILD.bazel.
constexpr KernelInstance kKernelInstances[] = {
// One MOE_XLA_CUTLASS_INSTANCE(out dtype, layout, epilogue) line per entry of the table,
// written by the build (cutlass_instances in bazel/cuda.bzl).
#include "cuda/gather_gemm_kernels.inc"
};
#undef MOE_XLA_CUTLASS_INSTANCE

// The layout of w that p names.
GroupedLayout w_layout(const GatherGemmParams& p) {
  return p.transpose_w ? GroupedLayout::kGmmTransposed : GroupedLayout::kGmm;
}

// The epilogue p asks for (common/gather_gemm.h).
GatherEpilogue epilogue(const GatherGemmParams& p) {
  if (!p.activated) return GatherEpilogue::kNone;
  return is_gated(p.activation) ? GatherEpilogue::kGated : GatherEpilogue::kPlain;
}

// Columns of out: N, or F = N / 2 for a gated activation.
int64_t out_cols(const GatherGemmParams& p) {
  return epilogue(p) == GatherEpilogue::kGated ? p.n / 2 : p.n;
}

// The kernel for p's output dtype, layout of w and epilogue, or null.
const KernelInstance* find_instance(const GatherGemmParams& p) {
  for (const KernelInstance& inst : kKernelInstances) {
    if (inst.out_dtype == p.out_dtype && inst.layout == w_layout(p) && inst.epilogue == epilogue(p)) return &inst;
  }
  return nullptr;
}

// The activation's extra requirements: w [G, K, N] and bf16 output (the compiled
// epilogues), an activation of common/expert_activation.h and, gated, N = 2F with
// F % 128 == 0 (the gate and up halves of a column tile are 128 columns each).
Status validate_activation(const GatherGemmParams& p) {
  const int32_t act = static_cast<int32_t>(p.activation);
  if (act < 0 || act >= kNumActivations) {
    return Status::InvalidArgument("gather_gemm: activation = " + std::to_string(act) + " is outside [0, " +
                                   std::to_string(kNumActivations) + ")");
  }
  if (p.transpose_w) {
    return Status::InvalidArgument("gather_gemm: an activation needs w [G, K, N], got transpose_w");
  }
  if (p.out_dtype != DType::kBF16) {
    return Status::InvalidArgument(std::string("gather_gemm: an activation needs bf16 output, got ") +
                                   dtype_name(p.out_dtype));
  }
  if (is_gated(p.activation) && p.n % 256 != 0) {
    return Status::InvalidArgument("gather_gemm: a gated activation needs n = 2F with F a multiple of 128, got n = " +
                                   std::to_string(p.n));
  }
  return Status();
}

// Shape and dtype errors that need no device: ok or an InvalidArgument naming the field.
// (Both output dtypes of the checks have an instance in both layouts, and the activation
// checks leave only its instances.) K is the row length of x, and of w when transposed
// ([G, N, K]); N that of out, and of w otherwise.
Status validate(const GatherGemmParams& p) {
  MOE_XLA_RETURN_IF_ERROR(detail::validate_gather("gather_gemm", "x and w", p.in_dtype, p.out_dtype,
                                                  {p.tokens, p.m, p.k, p.n, p.num_groups},
                                                  p.transpose_w ? "x and w" : "x",
                                                  p.transpose_w ? "out" : "w and out"));
  return p.activated ? validate_activation(p) : Status();
}

}  // namespace

size_t gather_gemm_workspace_bytes(int64_t m, int64_t num_groups) {
  if (m < 0 || m > kGatherMaxDim || num_groups < 0 || num_groups > kGatherMaxDim) return 0;
  return kAlign /* slack to align the base */ + detail::row_tile_table_bytes(m, num_groups, kGatherTileM);
}

size_t gather_gemm_workspace_bytes(const GatherGemmParams& p) {
  if (!validate(p).ok()) return 0;
  return gather_gemm_workspace_bytes(p.m, p.num_groups);
}

Status gather_gemm(const GatherGemmParams& p, void* workspace, size_t workspace_bytes,
                   cudaStream_t stream) {
  MOE_XLA_RETURN_IF_ERROR(validate(p));
  if (p.m == 0 || p.n == 0) return Status();  // nothing to write
  if (p.out == nullptr) return Status::InvalidArgument("gather_gemm: null output pointer");
  if (!aligned16(p.out)) return Status::InvalidArgument("gather_gemm: out is not 16-byte aligned");
  // Every row is zero when no group has a row, the dot products are empty or every src is
  // out of range.
  if (p.num_groups == 0 || p.k == 0 || p.tokens == 0) {
    MOE_XLA_RETURN_IF_CUDA_ERROR(
        cudaMemsetAsync(p.out, 0, static_cast<size_t>(p.m * out_cols(p)) * dtype_bytes(p.out_dtype), stream));
    return Status();
  }
  if (p.x == nullptr || p.w == nullptr || p.src == nullptr || p.group_sizes == nullptr) {
    return Status::InvalidArgument("gather_gemm: null x, w, src or group_sizes pointer");
  }
  if (!aligned16(p.x) || !aligned16(p.w)) {
    return Status::InvalidArgument("gather_gemm: x and w must be 16-byte aligned");
  }
  MOE_XLA_RETURN_IF_ERROR(require_device(DeviceSupport::kFull, "gather_gemm"));
  int sm_count = 0;
  MOE_XLA_RETURN_IF_ERROR(current_device_sm_count(&sm_count));
  const size_t needed = gather_gemm_workspace_bytes(p);
  MOE_XLA_RETURN_IF_ERROR(
      detail::check_workspace("gather_gemm", workspace, workspace_bytes, needed));

  const int64_t row_vecs = out_cols(p) * static_cast<int64_t>(dtype_bytes(p.out_dtype)) / 16;
  detail::RowTileTable table;
  MOE_XLA_RETURN_IF_ERROR(detail::enqueue_row_tile_table(p.group_sizes, p.num_groups, p.m, kGatherTileM,
                                                         detail::aligned_base(workspace), p.out, row_vecs,
                                                         sm_count, stream, &table));

  const detail::GatherGemmLaunch launch{&p, table, sm_count, stream};
  return find_instance(p)->run(launch).With("gather_gemm");
}

}  // namespace cuda
}  // namespace moe_xla
