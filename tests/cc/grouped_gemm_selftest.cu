// Standalone GPU self-check of moe_xla::cuda::grouped_gemm.
//
// For every case (shapes with empty groups, a huge group, negative sizes, sum < M,
// sum > M, M = 0, G = 1, odd K/N, many tiny groups) x layout x dtype combination x path
// (auto, fallback, each CUTLASS tile configuration the product is eligible for, the latter
// with both tile scheduler raster orders, and our short-K gmm kernel) it:
//   1. poisons the output with NaN and surrounds it with canaries,
//   2. runs grouped_gemm with exactly grouped_gemm_workspace_bytes of (misaligned) scratch,
//   3. compares with a host float64 reference: relative error max|out-ref| / max|ref|
//      (<= 1e-5 for f32 in and out, <= 1e-2 otherwise), exact zeros where no group writes,
//      no NaN, canaries intact,
//   4. captures the same call into a CUDA graph, changes group_sizes in device memory,
//      replays the graph and checks against the reference of the new sizes (proves the
//      sizes are read on the device at run time and the call is graph capturable).
// On a GPU other than compute capability 9.0 only the auto and fallback paths run (both
// are the SIMT kernels there); without a GPU it exits 0 saying it skipped.
// One line per case; exit status 1 if any case fails. Usage: grouped_gemm_selftest
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "common/grouped_gemm.h"
#include "common/status.h"
#include "cuda/device.h"
#include "cuda/grouped_gemm.h"
#include "tools/cuda_check.h"

namespace {

using moe_xla::DType;
using moe_xla::dtype_bytes;
using moe_xla::dtype_name;
using moe_xla::GroupedGemmParams;
using moe_xla::GroupedLayout;
using moe_xla::cuda::GroupedGemmConfig;
using moe_xla::cuda::GroupedGemmPath;
using moe_xla::cuda::GroupedGemmRaster;

const char* layout_name(GroupedLayout l) {
  switch (l) {
    case GroupedLayout::kGmm:
      return "gmm";
    case GroupedLayout::kGmmTransposed:
      return "gmm_t";
    case GroupedLayout::kTgmm:
      return "tgmm";
  }
  return "?";
}

// Rounds through the dtype and returns the stored bits (little-endian, dtype_bytes wide).
double round_to(DType d, float v, uint8_t* bits) {
  switch (d) {
    case DType::kF32:
      std::memcpy(bits, &v, 4);
      return v;
    case DType::kBF16: {
      __nv_bfloat16 h = __float2bfloat16_rn(v);
      std::memcpy(bits, &h, 2);
      return static_cast<double>(__bfloat162float(h));
    }
    case DType::kF16: {
      __half h = __float2half_rn(v);
      std::memcpy(bits, &h, 2);
      return static_cast<double>(__half2float(h));
    }
  }
  return 0;
}

double read_as_double(DType d, const uint8_t* bits) {
  switch (d) {
    case DType::kF32: {
      float f;
      std::memcpy(&f, bits, 4);
      return f;
    }
    case DType::kBF16: {
      __nv_bfloat16 h;
      std::memcpy(&h, bits, 2);
      return __bfloat162float(h);
    }
    case DType::kF16: {
      __half h;
      std::memcpy(&h, bits, 2);
      return __half2float(h);
    }
  }
  return 0;
}

struct Case {
  std::string name;
  int64_t m, k, n;
  std::vector<int32_t> sizes;
  std::vector<int32_t> replay_sizes;  // written to the device before the graph replay
  bool misalign = false;  // shift lhs, rhs and out by one element (not 16-byte aligned)
};

std::vector<int64_t> clamped_offsets(const std::vector<int32_t>& sizes, int64_t m) {
  std::vector<int64_t> off(sizes.size() + 1, 0);
  for (size_t g = 0; g < sizes.size(); ++g) {
    off[g + 1] = off[g] + moe_xla::clamp_group_size(sizes[g], off[g], m);
  }
  return off;
}

// Host float64 reference; `structural_zero` marks elements no group contributes to.
void reference(GroupedLayout layout, int64_t m, int64_t k, int64_t n, int64_t groups,
               const std::vector<int32_t>& sizes, const std::vector<double>& lhs,
               const std::vector<double>& rhs, std::vector<double>& out,
               std::vector<uint8_t>& structural_zero) {
  const std::vector<int64_t> off = clamped_offsets(sizes, m);
  if (layout == GroupedLayout::kTgmm) {
    out.assign(static_cast<size_t>(groups * k * n), 0.0);
    structural_zero.assign(out.size(), 0);
    for (int64_t g = 0; g < groups; ++g) {
      double* o = out.data() + g * k * n;
      if (off[g + 1] == off[g]) {
        std::fill(structural_zero.begin() + g * k * n, structural_zero.begin() + (g + 1) * k * n,
                  1);
        continue;
      }
      for (int64_t r = off[g]; r < off[g + 1]; ++r) {
        const double* a = lhs.data() + r * k;
        const double* b = rhs.data() + r * n;
        for (int64_t i = 0; i < k; ++i) {
          const double ai = a[i];
          double* orow = o + i * n;
          for (int64_t j = 0; j < n; ++j) orow[j] += ai * b[j];
        }
      }
    }
    return;
  }
  out.assign(static_cast<size_t>(m * n), 0.0);
  structural_zero.assign(out.size(), 0);
  std::vector<double> bt(static_cast<size_t>(k * n));
  for (int64_t g = 0; g < groups; ++g) {
    if (off[g + 1] == off[g]) continue;
    // bt[kk * n + j] = B_g[kk, j]
    for (int64_t kk = 0; kk < k; ++kk) {
      for (int64_t j = 0; j < n; ++j) {
        bt[kk * n + j] = layout == GroupedLayout::kGmm ? rhs[g * k * n + kk * n + j]
                                                       : rhs[g * n * k + j * k + kk];
      }
    }
    for (int64_t r = off[g]; r < off[g + 1]; ++r) {
      double* orow = out.data() + r * n;
      for (int64_t kk = 0; kk < k; ++kk) {
        const double a = lhs[r * k + kk];
        const double* brow = bt.data() + kk * n;
        for (int64_t j = 0; j < n; ++j) orow[j] += a * brow[j];
      }
    }
  }
  for (int64_t r = off[groups]; r < m; ++r) {
    std::fill(structural_zero.begin() + r * n, structural_zero.begin() + (r + 1) * n, 1);
  }
}

struct DeviceBuffer {
  void* ptr = nullptr;
  explicit DeviceBuffer(size_t bytes) { CHECK_CUDA(cudaMalloc(&ptr, std::max<size_t>(bytes, 1))); }
  ~DeviceBuffer() { cudaFree(ptr); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
};

constexpr size_t kCanaryBefore = 256;  // keeps the output 256-byte aligned
constexpr size_t kCanaryAfter = 4096;
constexpr uint8_t kCanaryByte = 0xA5;
constexpr size_t kWorkspaceMisalign = 8;  // grouped_gemm must cope with any scratch alignment

struct Check {
  bool ok = true;
  double rel_err = 0;
  std::string why;
};

Check compare(DType out_dtype, const std::vector<uint8_t>& got_with_canaries, size_t out_off,
              size_t out_bytes, const std::vector<double>& ref,
              const std::vector<uint8_t>& structural_zero, double tol) {
  Check c;
  for (size_t i = 0; i < out_off; ++i) {
    if (got_with_canaries[i] != kCanaryByte) {
      c.ok = false;
      c.why = "canary before the output overwritten";
      return c;
    }
  }
  for (size_t i = 0; i < kCanaryAfter; ++i) {
    if (got_with_canaries[out_off + out_bytes + i] != kCanaryByte) {
      c.ok = false;
      c.why = "canary after the output overwritten";
      return c;
    }
  }
  const size_t es = dtype_bytes(out_dtype);
  const uint8_t* got = got_with_canaries.data() + out_off;
  double max_ref = 0, max_err = 0;
  for (size_t i = 0; i < ref.size(); ++i) max_ref = std::max(max_ref, std::fabs(ref[i]));
  for (size_t i = 0; i < ref.size(); ++i) {
    const double v = read_as_double(out_dtype, got + i * es);
    if (std::isnan(v) || std::isinf(v)) {
      c.ok = false;
      c.why = "non-finite output at element " + std::to_string(i) + " (unwritten?)";
      return c;
    }
    if (structural_zero[i] && v != 0.0) {
      c.ok = false;
      c.why = "element " + std::to_string(i) + " outside every group is " + std::to_string(v) +
              ", expected 0";
      return c;
    }
    max_err = std::max(max_err, std::fabs(v - ref[i]));
  }
  c.rel_err = max_ref > 0 ? max_err / max_ref : max_err;
  if (!(c.rel_err <= tol)) {
    c.ok = false;
    c.why = "relative error " + std::to_string(c.rel_err) + " > " + std::to_string(tol);
  }
  return c;
}

// kAuto, then every concrete path; CUTLASS paths with both tile scheduler raster orders,
// each in CUTLASS's tile order (one team), in blocks of 3 waves with one cluster per team
// (each cluster walks its own stretch of tiles) and in blocks of 2 waves with teams of 4
// clusters (the grid's 66 clusters leave a smaller last team on the 2-CTA-cluster paths).
std::vector<GroupedGemmConfig> configs() {
  std::vector<GroupedGemmConfig> out(1);  // all auto
  for (GroupedGemmPath path : moe_xla::cuda::kGroupedGemmPaths) {
    GroupedGemmConfig c;
    c.path = path;
    if (path == GroupedGemmPath::kFallback || path == GroupedGemmPath::kResidentB64x256) {
      out.push_back(c);  // no tile scheduler: raster and team do not apply
      continue;
    }
    for (GroupedGemmRaster raster : {GroupedGemmRaster::kAlongM, GroupedGemmRaster::kAlongN}) {
      for (std::pair<int32_t, int32_t> team :
           {std::pair<int32_t, int32_t>{moe_xla::cuda::kTeamWholeGrid, 1}, {1, 3}, {4, 2}}) {
        c.raster = raster;
        c.team_clusters = team.first;
        c.team_waves = team.second;
        out.push_back(c);
      }
    }
  }
  return out;
}

struct Runner {
  int sm_count = 0;
  bool cutlass_device = false;  // compute capability 9.0: the CUTLASS paths run
  cudaStream_t stream = nullptr;
  int failures = 0;
  int cases = 0;

  void check_resident_path_error();

  void run_case(const Case& cs, GroupedLayout layout, DType in, DType out_dtype,
                std::mt19937& rng) {
    const int64_t groups = static_cast<int64_t>(cs.sizes.size());
    const int64_t m = cs.m, k = cs.k, n = cs.n;
    const int64_t lhs_elems = m * k;
    const int64_t rhs_elems = layout == GroupedLayout::kTgmm ? m * n : groups * k * n;
    const int64_t out_elems = layout == GroupedLayout::kTgmm ? groups * k * n : m * n;

    std::uniform_real_distribution<float> dist(-1.f, 1.f);
    const size_t ies = dtype_bytes(in), oes = dtype_bytes(out_dtype);
    std::vector<uint8_t> lhs_bits(lhs_elems * ies), rhs_bits(rhs_elems * ies);
    std::vector<double> lhs(lhs_elems), rhs(rhs_elems);
    for (int64_t i = 0; i < lhs_elems; ++i) lhs[i] = round_to(in, dist(rng), &lhs_bits[i * ies]);
    for (int64_t i = 0; i < rhs_elems; ++i) rhs[i] = round_to(in, dist(rng), &rhs_bits[i * ies]);

    std::vector<double> ref, ref_replay;
    std::vector<uint8_t> zero, zero_replay;
    reference(layout, m, k, n, groups, cs.sizes, lhs, rhs, ref, zero);
    reference(layout, m, k, n, groups, cs.replay_sizes, lhs, rhs, ref_replay, zero_replay);

    // Misaligned cases shift every operand by one element.
    const size_t in_shift = cs.misalign ? ies : 0;
    const size_t out_off = kCanaryBefore + (cs.misalign ? oes : 0);
    DeviceBuffer d_lhs(lhs_bits.size() + in_shift), d_rhs(rhs_bits.size() + in_shift);
    DeviceBuffer d_sizes(groups * sizeof(int32_t));
    const size_t out_bytes = out_elems * oes;
    const size_t out_total = out_off + out_bytes + kCanaryAfter;
    DeviceBuffer d_out(out_total);
    void* lhs_ptr = static_cast<char*>(d_lhs.ptr) + in_shift;
    void* rhs_ptr = static_cast<char*>(d_rhs.ptr) + in_shift;
    CHECK_CUDA(cudaMemcpy(lhs_ptr, lhs_bits.data(), lhs_bits.size(), cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMemcpy(rhs_ptr, rhs_bits.data(), rhs_bits.size(), cudaMemcpyHostToDevice));

    GroupedGemmParams p{};
    p.layout = layout;
    p.in_dtype = in;
    p.out_dtype = out_dtype;
    p.lhs = lhs_elems ? lhs_ptr : nullptr;
    p.rhs = rhs_elems ? rhs_ptr : nullptr;
    p.group_sizes = static_cast<const int32_t*>(d_sizes.ptr);
    p.out = static_cast<char*>(d_out.ptr) + out_off;
    p.m = m;
    p.k = k;
    p.n = n;
    p.num_groups = groups;

    const double tol = (in == DType::kF32 && out_dtype == DType::kF32) ? 1e-5 : 1e-2;
    const GroupedGemmPath auto_path = moe_xla::cuda::grouped_gemm_select_path(p, sm_count);

    for (const GroupedGemmConfig& config : configs()) {
      const GroupedGemmPath path = config.path;
      if (!moe_xla::cuda::grouped_gemm_path_supported(p, path)) continue;
      if (!cutlass_device && path != GroupedGemmPath::kAuto && path != GroupedGemmPath::kFallback) {
        continue;
      }
      ++cases;
      const size_t ws_bytes = moe_xla::cuda::grouped_gemm_workspace_bytes(p, sm_count, path);
      const size_t ws_bound = moe_xla::cuda::grouped_gemm_workspace_bytes_bound(m, groups, sm_count);
      DeviceBuffer d_ws(ws_bytes + kWorkspaceMisalign);
      void* ws = static_cast<char*>(d_ws.ptr) + kWorkspaceMisalign;

      auto poison = [&](const std::vector<int32_t>& sizes) {
        if (groups) {
          CHECK_CUDA(cudaMemcpyAsync(d_sizes.ptr, sizes.data(), groups * sizeof(int32_t),
                                     cudaMemcpyHostToDevice, stream));
        }
        CHECK_CUDA(cudaMemsetAsync(d_out.ptr, kCanaryByte, out_total, stream));
        CHECK_CUDA(cudaMemsetAsync(p.out, 0xFF, out_bytes, stream));  // NaN in f32/bf16/f16
        CHECK_CUDA(cudaStreamSynchronize(stream));
      };
      auto fetch = [&]() {
        std::vector<uint8_t> got(out_total);
        CHECK_CUDA(cudaMemcpy(got.data(), d_out.ptr, got.size(), cudaMemcpyDeviceToHost));
        return got;
      };

      // Direct call.
      poison(cs.sizes);
      const moe_xla::Status status =
          moe_xla::cuda::grouped_gemm(p, ws, ws_bytes, sm_count, stream, config);
      Check direct;
      if (!status.ok()) {
        direct.ok = false;
        direct.why = "grouped_gemm returned: " + status.message();
      } else {
        const cudaError_t e = cudaStreamSynchronize(stream);
        if (e != cudaSuccess) {
          std::printf("FATAL  %s: CUDA error %s (device state is lost)\n", cs.name.c_str(),
                      cudaGetErrorString(e));
          std::exit(2);
        }
        direct = compare(out_dtype, fetch(), out_off, out_bytes, ref, zero, tol);
      }

      // Graph capture, new sizes in device memory, replay.
      Check replay;
      {
        poison(cs.sizes);
        cudaGraph_t graph = nullptr;
        cudaGraphExec_t exec = nullptr;
        CHECK_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
        const moe_xla::Status captured =
            moe_xla::cuda::grouped_gemm(p, ws, ws_bytes, sm_count, stream, config);
        const cudaError_t end = cudaStreamEndCapture(stream, &graph);
        if (!captured.ok() || end != cudaSuccess) {
          replay.ok = false;
          replay.why = "graph capture failed: " +
                       (captured.ok() ? std::string(cudaGetErrorString(end)) : captured.message());
          cudaGetLastError();
        } else {
          CHECK_CUDA(cudaGraphInstantiate(&exec, graph, 0));
          poison(cs.replay_sizes);
          CHECK_CUDA(cudaGraphLaunch(exec, stream));
          const cudaError_t e = cudaStreamSynchronize(stream);
          if (e != cudaSuccess) {
            std::printf("FATAL  %s: CUDA error %s in graph replay\n", cs.name.c_str(),
                        cudaGetErrorString(e));
            std::exit(2);
          }
          replay = compare(out_dtype, fetch(), out_off, out_bytes, ref_replay, zero_replay, tol);
          CHECK_CUDA(cudaGraphExecDestroy(exec));
        }
        if (graph) CHECK_CUDA(cudaGraphDestroy(graph));
      }

      if (ws_bytes > ws_bound) {
        direct.ok = false;
        direct.why = "workspace bytes " + std::to_string(ws_bytes) + " exceed the bound " +
                     std::to_string(ws_bound);
      }
      const bool ok = direct.ok && replay.ok;
      if (!ok) ++failures;
      char line[512];
      std::snprintf(line, sizeof(line),
                    "%s  %-5s %-4s->%-4s path=%-26s %-7s team=%-5s (auto=%s) M=%lld K=%lld "
                    "N=%lld G=%lld  %-22s err=%.2e replay_err=%.2e",
                    ok ? "PASS" : "FAIL", layout_name(layout), dtype_name(in),
                    dtype_name(out_dtype), moe_xla::cuda::grouped_gemm_path_name(path),
                    moe_xla::cuda::grouped_gemm_raster_name(config.raster),
                    moe_xla::cuda::grouped_gemm_team_name(config).c_str(),
                    moe_xla::cuda::grouped_gemm_path_name(auto_path), (long long)m, (long long)k,
                    (long long)n, (long long)groups, cs.name.c_str(), direct.rel_err,
                    replay.rel_err);
      std::printf("%s", line);
      if (!direct.ok) std::printf("  [direct: %s]", direct.why.c_str());
      if (!replay.ok) std::printf("  [graph replay: %s]", replay.why.c_str());
      std::printf("\n");
      std::fflush(stdout);
    }
  }
};

// A product the resident-B path cannot compute (tgmm) forced onto it: an error that names
// the path, what it needs and the product, and no launch.
void Runner::check_resident_path_error() {
  DeviceBuffer lhs(64 * 64 * 2), rhs(64 * 64 * 2), sizes(sizeof(int32_t)), out(64 * 64 * 2);
  CHECK_CUDA(cudaMemset(sizes.ptr, 0, sizeof(int32_t)));
  GroupedGemmParams p{};
  p.layout = GroupedLayout::kTgmm;
  p.in_dtype = p.out_dtype = DType::kBF16;
  p.lhs = lhs.ptr;
  p.rhs = rhs.ptr;
  p.group_sizes = static_cast<const int32_t*>(sizes.ptr);
  p.out = out.ptr;
  p.m = p.k = p.n = 64;
  p.num_groups = 1;
  GroupedGemmConfig config;
  config.path = GroupedGemmPath::kResidentB64x256;
  const size_t ws_bytes = moe_xla::cuda::grouped_gemm_workspace_bytes_bound(p.m, p.num_groups, sm_count);
  DeviceBuffer ws(ws_bytes);
  const moe_xla::Status status = moe_xla::cuda::grouped_gemm(p, ws.ptr, ws_bytes, sm_count, stream, config);
  const std::string message = status.ok() ? "" : status.message();
  const bool ok = !status.ok() && message.find("resident_b64x256 needs gmm with rhs [G, K, N]") != std::string::npos &&
                  message.find("got tgmm, bf16 -> bf16, M 64, K 64, N 64") != std::string::npos;
  ++cases;
  if (!ok) ++failures;
  std::printf("%s  forced resident_b64x256 on a tgmm: %s\n", ok ? "PASS" : "FAIL",
              status.ok() ? "no error" : message.c_str());
}

std::vector<Case> make_cases(std::mt19937& rng) {
  std::vector<Case> cases;
  auto random_sizes = [&](int64_t groups, int lo, int hi) {
    std::uniform_int_distribution<int> d(lo, hi);
    std::vector<int32_t> s(groups);
    for (auto& v : s) v = d(rng);
    return s;
  };
  // Aligned shapes (CUTLASS-eligible for 16-bit types): zeros, sum < M, ragged sizes.
  cases.push_back({"zeros_sum_lt_m", 1000, 256, 384, {100, 0, 300, 0, 7, 250, 0, 200},
                   {0, 500, 0, 0, 129, 1, 64, 3}});
  // One huge group (clamped to M), negative sizes, groups after the clamp are empty.
  cases.push_back({"huge_and_negative", 700, 128, 256, {50, 2000000000, 10, -5, 30},
                   {-1, 3, 2000000000, 0, 700}});
  // Sum > M: the last group is cut.
  cases.push_back({"sum_gt_m", 520, 64, 136, {200, 200, 200}, {0, 0, 1000}});
  // A single group.
  cases.push_back({"single_group", 333, 96, 200, {333}, {100}});
  // M = 0 (gmm: empty output; tgmm: all-zero output).
  cases.push_back({"m_zero", 0, 64, 72, {0, 5, 0}, {3, 0, -2}});
  // No groups at all (gmm: all rows zero; tgmm: empty output).
  cases.push_back({"no_groups", 64, 16, 24, {}, {}});
  // Odd K and N (fallback only for every dtype).
  cases.push_back({"odd_k_n", 301, 67, 33, {100, 0, 150, 60}, {301, 0, 0, 0}});
  // K, N = 8: smallest aligned shape.
  cases.push_back({"tiny_aligned", 50, 8, 8, {20, 0, 30}, {0, 50, 0}});
  // Aligned shape, but operands not 16-byte aligned: fallback only.
  cases.push_back({"misaligned_ptrs", 400, 64, 128, {150, 0, 200}, {0, 399, 1}, true});
  // Many small groups, many empty (decode-like, small tiles).
  cases.push_back({"many_small_groups", 900, 128, 256, random_sizes(300, -2, 6),
                   random_sizes(300, 0, 4)});
  // Large groups, wide N (large tiles), K not a multiple of any K tile.
  cases.push_back({"large_groups", 2048, 200, 512, {900, 0, 700, 448}, {448, 700, 0, 900}});
  // Output tile edges in every direction and more groups than one scan chunk.
  cases.push_back({"many_groups_scan", 1500, 24, 40, random_sizes(2500, -1, 2),
                   random_sizes(2500, 0, 1)});
  // Several tiles per cluster of the persistent grid (up to ~10 per cluster with 2-CTA
  // clusters), so that the tile scheduler's teams deal out long stretches and uneven shares.
  cases.push_back({"many_tiles", 3000, 32, 1536, random_sizes(37, -3, 160),
                   random_sizes(37, 0, 90)});
  // Short K (three of the short-K kernel's four 64-deep B chunks, so its B stages rotate
  // from unit to unit) with a group longer than its row tiles of 2048 rows, groups ending
  // inside a 64-row sub-tile, and N past a 256-column tile.
  cases.push_back({"short_k_long_groups", 4400, 192, 264, {2300, 0, 1500, 551},
                   {0, 4399, 1, 0}});
  return cases;
}

}  // namespace

int main() {
  exit_if_no_cuda_device("grouped_gemm_selftest");
  Runner runner;
  moe_xla::cuda::DeviceSupport support;
  int cc_major = 0, cc_minor = 0;
  const moe_xla::Status device_status =
      moe_xla::cuda::current_device_support(&support, &cc_major, &cc_minor);
  if (!device_status.ok()) {
    std::printf("FATAL  %s\n", device_status.message().c_str());
    return 2;
  }
  runner.cutlass_device = support == moe_xla::cuda::DeviceSupport::kFull;
  int device = 0;
  CHECK_CUDA(cudaGetDevice(&device));
  CHECK_CUDA(cudaDeviceGetAttribute(&runner.sm_count, cudaDevAttrMultiProcessorCount, device));
  cudaDeviceProp prop{};
  CHECK_CUDA(cudaGetDeviceProperties(&prop, device));
  std::printf("device %d: %s (sm_%d%d, %d SMs)%s\n", device, prop.name, prop.major, prop.minor,
              runner.sm_count, runner.cutlass_device ? "" : ": SIMT paths only");
  CHECK_CUDA(cudaStreamCreateWithFlags(&runner.stream, cudaStreamNonBlocking));

  std::mt19937 rng(12345);
  const std::vector<Case> cases = make_cases(rng);
  const std::pair<DType, DType> dtypes[] = {
      {DType::kBF16, DType::kBF16}, {DType::kF16, DType::kF16},  {DType::kF32, DType::kF32},
      {DType::kBF16, DType::kF32},  {DType::kF16, DType::kF32},  {DType::kF32, DType::kBF16},
  };
  for (const Case& cs : cases) {
    for (GroupedLayout layout :
         {GroupedLayout::kGmm, GroupedLayout::kGmmTransposed, GroupedLayout::kTgmm}) {
      for (const auto& dt : dtypes) runner.run_case(cs, layout, dt.first, dt.second, rng);
    }
  }
  if (runner.cutlass_device) runner.check_resident_path_error();
  CHECK_CUDA(cudaStreamDestroy(runner.stream));
  std::printf("%s: %d of %d checks failed\n", runner.failures ? "FAILED" : "OK", runner.failures,
              runner.cases);
  return runner.failures ? 1 : 0;
}
