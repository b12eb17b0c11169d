// Dispatcher of the FP8 wgrad (cuda/fp8_wgrad.h): argument checks, path choice, the
// CUTLASS instantiations and those of our kernel (fp8_wgrad_wgmma_kernel.cuh) of the wgrad
// tables in cuda/BUILD.bazel, and the SIMT kernel that computes the contract's order
// exactly.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "common/fp8_blockwise.h"
#include "common/status.h"
#include "cuda/device.h"
#include "cuda/fp8_grouped_gemm_internal.h"
#include "cuda/fp8_wgrad.h"
#include "cuda/fp8_wgrad_wgmma_internal.h"
#include "cuda/group_offsets.cuh"

namespace moe_xla {
namespace cuda {
namespace {

using detail::align_up;
using detail::CutlassFp8WgradArgs;
using detail::Fp8TileConfig;
using detail::kScanThreads;
using detail::kWorkspaceAlign;

bool aligned16(const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15u) == 0; }

// Sizes that keep every index product in range, the CUTLASS shapes in int32 included.
bool sizes_in_range(const Fp8WgradParams& p) {
  if (p.m < 0 || p.k < 0 || p.n < 0 || p.num_groups < 0) return false;
  constexpr int64_t kMaxDim = INT32_MAX / 2;
  const int64_t width = fp8::kTile * (p.m / fp8::kTile + 1 + p.num_groups);
  if (p.m > kMaxDim || p.k > kMaxDim || p.n > kMaxDim || p.num_groups > kMaxDim || width > kMaxDim) return false;
  constexpr __int128 kMaxElems = static_cast<__int128>(1) << 62;
  return static_cast<__int128>(width) * (p.k > p.n ? p.k : p.n) < kMaxElems &&
         static_cast<__int128>(p.num_groups) * p.k * p.n < kMaxElems;
}

struct CutlassWgradInstance {
  DType out_dtype;
  Fp8TileConfig tile;
  size_t (*workspace_bytes)(int64_t num_groups, int sm_count);
  Status (*run)(const CutlassFp8WgradArgs& args);
};

#define MOE_XLA_CUTLASS_INSTANCE(DTYPE, TILE)                                                       \
  CutlassWgradInstance{DType::DTYPE, Fp8TileConfig::TILE,                                           \
                       &detail::cutlass_fp8_wgrad_workspace_bytes<DType::DTYPE, Fp8TileConfig::TILE>, \
                       &detail::cutlass_fp8_wgrad_run<DType::DTYPE, Fp8TileConfig::TILE>},

constexpr CutlassWgradInstance kCutlassWgradInstances[] = {
// One MOE_XLA_CUTLASS_INSTANCE(dtype, tile) line per entry of the table, written by the
// build (cutlass_instances in bazel/cuda.bzl).
#include "cuda/fp8_wgrad_cutlass.inc"
};
#undef MOE_XLA_CUTLASS_INSTANCE

// The instantiation that computes this wgrad, or nullptr when none can (output dtype not
// instantiated, shapes, alignment). TMA needs 16-byte aligned bases and leading
// dimensions: the operands' rows are 128 T bytes long and groups start at whole tiles.
const CutlassWgradInstance* cutlass_instance_for(const Fp8WgradParams& p, Fp8WgradPath path) {
  if (path != Fp8WgradPath::kCutlass && path != Fp8WgradPath::kPingpong) return nullptr;
  const Fp8TileConfig tile =
      path == Fp8WgradPath::kCutlass ? Fp8TileConfig::kCoop128x128Cluster1x2 : Fp8TileConfig::kPingpong64x128Cluster1x1;
  if (!sizes_in_range(p) || p.k <= 0 || p.n <= 0 || p.num_groups <= 0) return nullptr;
  const int64_t out_vec = 16 / static_cast<int64_t>(dtype_bytes(p.out_dtype));
  if (p.n % out_vec != 0) return nullptr;
  if (!aligned16(p.lhs_t) || !aligned16(p.rhs_t) || !aligned16(p.out)) return nullptr;
  for (const CutlassWgradInstance& inst : kCutlassWgradInstances) {
    if (inst.out_dtype == p.out_dtype && inst.tile == tile) return &inst;
  }
  return nullptr;
}

struct WgmmaWgradInstance {
  DType out_dtype;
  detail::Fp8WgradTile tile;
  Status (*run)(const detail::Fp8WgradWgmmaLaunch& launch);
};

#define MOE_XLA_CUTLASS_INSTANCE(DTYPE, TILE) \
  WgmmaWgradInstance{DType::DTYPE, detail::Fp8WgradTile::TILE, &detail::fp8_wgrad_wgmma_run<DType::DTYPE, detail::Fp8WgradTile::TILE>},

constexpr WgmmaWgradInstance kWgmmaWgradInstances[] = {
// One MOE_XLA_CUTLASS_INSTANCE(dtype, tile) line per entry of the table, written by the
// build (cutlass_instances in bazel/cuda.bzl).
#include "cuda/fp8_wgrad_wgmma_kernels.inc"
};
#undef MOE_XLA_CUTLASS_INSTANCE

// Our kernel's instantiation that computes this wgrad, or nullptr when none can: TMA
// needs 16-byte aligned bases and row strides (the scales' rows are K and N floats), the
// staged store whole 16-byte chunks of N.
const WgmmaWgradInstance* wgmma_instance_for(const Fp8WgradParams& p, Fp8WgradPath path) {
  if (path != Fp8WgradPath::kWgmma128x128 && path != Fp8WgradPath::kWgmma128x192) return nullptr;
  const detail::Fp8WgradTile tile =
      path == Fp8WgradPath::kWgmma128x128 ? detail::Fp8WgradTile::kN128 : detail::Fp8WgradTile::kN192;
  if (!sizes_in_range(p) || p.k <= 0 || p.n <= 0 || p.num_groups <= 0) return nullptr;
  if (p.k % 4 != 0 || p.n % 8 != 0) return nullptr;
  if (!aligned16(p.lhs_t) || !aligned16(p.rhs_t) || !aligned16(p.out) || !aligned16(p.lhs_scales) ||
      !aligned16(p.rhs_scales)) {
    return nullptr;
  }
  for (const WgmmaWgradInstance& inst : kWgmmaWgradInstances) {
    if (inst.out_dtype == p.out_dtype && inst.tile == tile) return &inst;
  }
  return nullptr;
}

// Workspace of the SIMT and wgmma paths: first tile and tile count of every group.
size_t tiles_bytes(int64_t num_groups) {
  return align_up(static_cast<size_t>(2 * num_groups) * sizeof(int64_t), kWorkspaceAlign);
}

__global__ void __launch_bounds__(kScanThreads)
    wgrad_tiles_kernel(const int32_t* __restrict__ group_sizes, int64_t num_groups, int64_t m,
                       int64_t* __restrict__ tiles) {
  int64_t group_tiles = 0;
  detail::scan_group_tiles<kScanThreads>(group_sizes, num_groups, m, fp8::kTile, &group_tiles,
                                         [&](int64_t g, int64_t start, int64_t end, int64_t first) {
                                           tiles[2 * g] = first;
                                           tiles[2 * g + 1] = fp8::tiles(end - start);
                                         });
}

constexpr int kSimtThreads = fp8::kTile;  // one output column per thread

// SIMT path: block (x, y, z) computes out[g, k, 128 x .. 128 x + 127] for k = y and the
// groups g = z, z + gridDim.z, ... Per tile the row k of lhs_t goes through shared memory;
// each thread sums its column's products in column order and adds them with the
// contract's two roundings, so the result is bitwise the CPU kernel's.
template <class Out>
__global__ void __launch_bounds__(kSimtThreads)
    wgrad_simt_kernel(Fp8WgradParams p, const int64_t* __restrict__ tiles, int64_t width) {
  __shared__ float a[fp8::kTile];
  const int64_t k = blockIdx.y;
  const int64_t n = static_cast<int64_t>(blockIdx.x) * kSimtThreads + threadIdx.x;
  const int64_t nc = n < p.n ? n : 0;  // a valid column for the threads past N
  for (int64_t g = blockIdx.z; g < p.num_groups; g += gridDim.z) {
    const int64_t first = tiles[2 * g], count = tiles[2 * g + 1];
    float acc = 0.0f;
    for (int64_t t = first; t < first + count; ++t) {
      __syncthreads();  // the previous tile's values are no longer read
      a[threadIdx.x] = fp8::fp8_e4m3_to_float(p.lhs_t[k * width + t * fp8::kTile + threadIdx.x]);
      __syncthreads();
      const uint8_t* b = p.rhs_t + nc * width + t * fp8::kTile;
      float partial = 0.0f;
      for (int c = 0; c < fp8::kTile; ++c) partial = __fadd_rn(partial, __fmul_rn(a[c], fp8::fp8_e4m3_to_float(b[c])));
      acc = __fmaf_rn(__fmul_rn(partial, p.lhs_scales[t * p.k + k]), p.rhs_scales[t * p.n + nc], acc);
    }
    if (n < p.n) static_cast<Out*>(p.out)[(g * p.k + k) * p.n + n] = Out(acc);
  }
}

// Enqueues the kernel that writes each group's first tile and tile count into `tiles`
// (the SIMT and wgmma paths read them).
Status enqueue_group_tiles(const Fp8WgradParams& p, int64_t* tiles, cudaStream_t stream) {
  wgrad_tiles_kernel<<<1, kScanThreads, 0, stream>>>(p.group_sizes, p.num_groups, p.m, tiles);
  MOE_XLA_RETURN_IF_CUDA_ERROR(cudaGetLastError());
  return Status();
}

Status simt_run(const Fp8WgradParams& p, int64_t* tiles, cudaStream_t stream) {
  MOE_XLA_RETURN_IF_ERROR(enqueue_group_tiles(p, tiles, stream));
  if (p.k > 65535) return Status::InvalidArgument("fp8_wgrad path simt: K above 65535");
  const int64_t width = fp8::kTile * group_col_tiles(p.m, p.num_groups);
  const dim3 grid(static_cast<unsigned>((p.n + kSimtThreads - 1) / kSimtThreads), static_cast<unsigned>(p.k),
                  static_cast<unsigned>(std::min<int64_t>(p.num_groups, 65535)));
  if (p.out_dtype == DType::kBF16) {
    wgrad_simt_kernel<__nv_bfloat16><<<grid, kSimtThreads, 0, stream>>>(p, tiles, width);
  } else {
    wgrad_simt_kernel<float><<<grid, kSimtThreads, 0, stream>>>(p, tiles, width);
  }
  MOE_XLA_RETURN_IF_CUDA_ERROR(cudaGetLastError());
  return Status();
}

const char* path_name(Fp8WgradPath path) {
  switch (path) {
    case Fp8WgradPath::kAuto: return "auto";
    case Fp8WgradPath::kSimt: return "simt";
    case Fp8WgradPath::kCutlass: return "cutlass";
    case Fp8WgradPath::kPingpong: return "pingpong";
    case Fp8WgradPath::kWgmma128x128: return "wgmma128x128";
    case Fp8WgradPath::kWgmma128x192: return "wgmma128x192";
  }
  return "unknown";
}

// Whether our 128 x 192 tiles beat 128 x 128 ones: unless the clusters' pairs of
// 192-column tiles put more than 8% of the columns they compute past N. On the H200 they
// ran 5-6% more useful TFLOP/s where they compute at most 3% past N (about 8% more per
// computed column), and 2% fewer at N 2048 (11% of the 2304 computed columns past N).
bool wide_tiles_pay(const Fp8WgradParams& p) {
  constexpr int64_t kPair = 2 * 192;
  const int64_t columns = (p.n + kPair - 1) / kPair * kPair;
  return (columns - p.n) * 100 <= columns * 8;
}

}  // namespace

Fp8WgradPath fp8_wgrad_select_path(const Fp8WgradParams& p) {
  const Fp8WgradPath ours = wide_tiles_pay(p) ? Fp8WgradPath::kWgmma128x192 : Fp8WgradPath::kWgmma128x128;
  if (wgmma_instance_for(p, ours) != nullptr) return ours;
  if (cutlass_instance_for(p, Fp8WgradPath::kCutlass) != nullptr) return Fp8WgradPath::kCutlass;
  return Fp8WgradPath::kSimt;
}

size_t fp8_wgrad_workspace_bytes_bound(int64_t num_groups, int max_sm_count) {
  size_t cutlass_bytes = 0;
  for (const CutlassWgradInstance& inst : kCutlassWgradInstances) {
    cutlass_bytes = std::max(cutlass_bytes, inst.workspace_bytes(std::max<int64_t>(num_groups, 1), std::max(max_sm_count, 1)));
  }
  return kWorkspaceAlign + std::max(tiles_bytes(num_groups), align_up(cutlass_bytes, kWorkspaceAlign));
}

Status fp8_wgrad(const Fp8WgradParams& p, void* workspace, size_t workspace_bytes, int sm_count, cudaStream_t stream,
                 Fp8WgradPath path) {
  if (p.out_dtype != DType::kBF16 && p.out_dtype != DType::kF32) {
    return Status::InvalidArgument("fp8_wgrad: output dtype must be bf16 or f32, got " +
                                   std::string(dtype_name(p.out_dtype)));
  }
  if (!sizes_in_range(p)) return Status::InvalidArgument("fp8_wgrad: negative or too large dimensions");
  if (sm_count <= 0) return Status::InvalidArgument("fp8_wgrad: sm_count must be positive");

  DeviceSupport support;
  int cc_major = 0, cc_minor = 0;
  MOE_XLA_RETURN_IF_ERROR(current_device_support(&support, &cc_major, &cc_minor));
  if (support == DeviceSupport::kNone) {
    return Status::FailedPrecondition(device_support_error(cc_major, cc_minor, DeviceSupport::kSimt, "fp8_wgrad"));
  }
  if (path == Fp8WgradPath::kAuto) {
    path = support == DeviceSupport::kFull ? fp8_wgrad_select_path(p) : Fp8WgradPath::kSimt;
  }
  if (path != Fp8WgradPath::kSimt && support != DeviceSupport::kFull) {
    const std::string what = std::string("fp8_wgrad path ") + path_name(path);
    return Status::FailedPrecondition(device_support_error(cc_major, cc_minor, DeviceSupport::kFull, what.c_str()));
  }
  const CutlassWgradInstance* inst = cutlass_instance_for(p, path);
  const WgmmaWgradInstance* wgmma = wgmma_instance_for(p, path);

  const size_t out_bytes = static_cast<size_t>(p.num_groups * p.k * p.n) * dtype_bytes(p.out_dtype);
  if (out_bytes == 0) return Status();
  if (p.out == nullptr) return Status::InvalidArgument("fp8_wgrad: null output pointer");
  if (p.lhs_t == nullptr || p.rhs_t == nullptr || p.lhs_scales == nullptr || p.rhs_scales == nullptr ||
      p.group_sizes == nullptr) {
    return Status::InvalidArgument("fp8_wgrad: null input pointer");
  }
  const size_t needed = fp8_wgrad_workspace_bytes_bound(p.num_groups, sm_count);
  if (workspace == nullptr || workspace_bytes < needed) {
    return Status::InvalidArgument("fp8_wgrad: workspace of " + std::to_string(workspace == nullptr ? 0 : workspace_bytes) +
                                   " bytes, it needs " + std::to_string(needed));
  }
  const uintptr_t raw = reinterpret_cast<uintptr_t>(workspace);
  const uintptr_t aligned = (raw + kWorkspaceAlign - 1) & ~static_cast<uintptr_t>(kWorkspaceAlign - 1);
  char* base = reinterpret_cast<char*>(aligned);
  const size_t usable = workspace_bytes - (aligned - raw);

  if (path == Fp8WgradPath::kSimt) return simt_run(p, reinterpret_cast<int64_t*>(base), stream).With("fp8_wgrad path simt");
  if (wgmma != nullptr) {
    int64_t* tiles = reinterpret_cast<int64_t*>(base);
    MOE_XLA_RETURN_IF_ERROR(enqueue_group_tiles(p, tiles, stream));
    return wgmma->run(detail::Fp8WgradWgmmaLaunch{&p, tiles, stream}).With(std::string("fp8_wgrad path ") + path_name(path));
  }
  if (inst == nullptr) {
    return Status::InvalidArgument(std::string("fp8_wgrad: the path ") + path_name(path) +
                                   " does not support this output dtype, shape or alignment");
  }
  return inst->run(CutlassFp8WgradArgs{&p, base, usable, sm_count, stream})
      .With(std::string("fp8_wgrad path ") + path_name(path));
}

}  // namespace cuda
}  // namespace moe_xla
