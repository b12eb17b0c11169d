// Tuning benchmark of moe_xla::cuda::grouped_gemm: every CUTLASS configuration x tile
// scheduler raster order (or, with --teams, each case's default configuration x tile
// scheduler team sizes) on the grouped_matmul cases of benchmarks/cases.json and the two
// expert products of its sonicmoe layers, in one run.
//
// For each case (both group-size distributions, sizes exactly as benchmarks/_timing.py draws
// them: tools/bench_cases.py writes them into bench_cases.inc at build time) and each of
// the four products the library runs,
//   fwd    kGmm            lhs [M,K] @ rhs[g] [K,N]        -> [M,N]  (moe_xla.gmm forward)
//   fwd_t  kGmmTransposed  lhs [M,K] @ rhs[g] [N,K]^T      -> [M,N]  (forward with K-major
//                                                                     weights, torch's layout)
//   dlhs   kGmmTransposed  ct  [M,N] @ rhs[g] [K,N]^T      -> [M,K]  (backward, d lhs)
//   drhs   kTgmm           lhs[rows g]^T @ ct[rows g]      -> [G,K,N] (backward, d rhs)
// on random bf16 data generated on the device, it
//   1. runs the default configuration (kAuto) once and spot-checks 256 of its output
//      elements against a float64 dot product on the device,
//   2. for every eligible (path, raster order) or team-size variant: runs it once into a
//      NaN-poisoned output and compares with the default output (max |diff| / max |ref|
//      < 1e-2, no NaN), then untimed calls back to back, `--warmup` of them and more until
//      `--sustain-ms` has passed (default 0; short runs time a cool GPU, whose clock a
//      longer load lowers), and `--reps` timed calls (one pair of CUDA events around each call, calls
//      enqueued back to back), and keeps the median,
//   3. prints TFLOP/s (2*M*K*N per product) per variant and case as one table per product,
//      and at the end the best variant per case and product and, per product, each
//      variant's geometric-mean speed-up over the default across the cases.
// Times are of the whole grouped_gemm call (on the CUTLASS paths the prep kernel, the GEMM
// and for tgmm the zeroing of empty groups), as the FFI handler runs it.
// It ranks moe_xla's own configurations; torch._grouped_mm is measured against the library
// in the same run by benchmarks/gmm.py and benchmarks/gmm_sustained.py.
//
// Usage: grouped_gemm_bench [--reps N] [--warmup N] [--sustain-ms N] [--case SUBSTR]... [--op NAME]...
//                           [--no-check] [--teams]
//   --case keeps cases whose "name groups" contains SUBSTR (e.g. qwen, zipf, "down uniform");
//   --op keeps products by name (fwd, fwd_t, dlhs, drhs). Exit status 1 if a check failed.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "common/grouped_gemm.h"
#include "common/status.h"
#include "cuda/grouped_gemm.h"
#include "tools/cuda_check.h"

namespace {

using moe_xla::DType;
using moe_xla::GroupedGemmParams;
using moe_xla::GroupedLayout;
using moe_xla::cuda::GroupedGemmConfig;
using moe_xla::cuda::GroupedGemmPath;
using moe_xla::cuda::GroupedGemmRaster;

struct BenchCase {
  const char* name;
  const char* groups;  // "uniform" or "zipf1.2"
  int64_t m, g, k, n;
  std::vector<int32_t> sizes;
};

const BenchCase kCases[] = {
#include "tools/bench_cases.inc"
};

enum class Op : int { kFwd = 0, kFwdT = 1, kDlhs = 2, kDrhs = 3 };
constexpr int kNumOps = 4;
const char* const kOpNames[kNumOps] = {"fwd", "fwd_t", "dlhs", "drhs"};

// Column label: "qwen.gu/u".
std::string short_case_name(const BenchCase& c) {
  const std::string name = c.name;
  std::string model = name.substr(0, name.find_first_of("-."));
  if (model.rfind("qwen", 0) == 0) model = "qwen";
  if (model.rfind("deepseek", 0) == 0) model = "dsv3";
  if (model.rfind("mixtral", 0) == 0) model = "mixt";
  if (model == "sonicmoe") model = name.substr(13, name.find('-', 13) - 13);  // "n256", ...
  const std::string proj = name.find("gate_up") != std::string::npos ? "gu"
                           : name.find("down") != std::string::npos  ? "dn"
                                                                      : "?";
  return model + "." + proj + "/" + (std::strncmp(c.groups, "zipf", 4) == 0 ? "z" : "u");
}

// ----- device helpers --------------------------------------------------------------------

__device__ __forceinline__ uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// Normal(0, scale^2) bf16 values from a counter-based hash (Box-Muller).
__global__ void fill_normal_kernel(__nv_bfloat16* out, int64_t n, uint64_t seed, float scale) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    const uint64_t h = splitmix64(seed * 0x100000001B3ull + static_cast<uint64_t>(i));
    const float u1 = (static_cast<float>(h >> 40) + 1.0f) * (1.0f / 16777216.0f);  // (0, 1]
    const float u2 = static_cast<float>((h >> 16) & 0xFFFFFF) * (1.0f / 16777216.0f);
    const float z = sqrtf(-2.0f * logf(u1)) * cospif(2.0f * u2);
    out[i] = __float2bfloat16_rn(z * scale);
  }
}

struct CompareResult {
  unsigned int max_diff_bits;  // float bits of max |out - ref| (non-negative floats order as
  unsigned int max_ref_bits;   // unsigned ints)
  unsigned long long nan_count;
};

__global__ void compare_kernel(const __nv_bfloat16* __restrict__ out,
                               const __nv_bfloat16* __restrict__ ref, int64_t n,
                               CompareResult* result) {
  float max_diff = 0.f, max_ref = 0.f;
  unsigned long long nans = 0;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    const float o = __bfloat162float(out[i]), r = __bfloat162float(ref[i]);
    if (!isfinite(o) || !isfinite(r)) {
      ++nans;
      continue;
    }
    max_diff = fmaxf(max_diff, fabsf(o - r));
    max_ref = fmaxf(max_ref, fabsf(r));
  }
  for (int d = 16; d > 0; d >>= 1) {
    max_diff = fmaxf(max_diff, __shfl_xor_sync(0xffffffffu, max_diff, d));
    max_ref = fmaxf(max_ref, __shfl_xor_sync(0xffffffffu, max_ref, d));
    nans += __shfl_xor_sync(0xffffffffu, nans, d);
  }
  if ((threadIdx.x & 31) == 0) {
    atomicMax(&result->max_diff_bits, __float_as_uint(max_diff));
    atomicMax(&result->max_ref_bits, __float_as_uint(max_ref));
    if (nans) atomicAdd(&result->nan_count, nans);
  }
}

// One sampled output element and the float64 dot product that defines it.
struct Sample {
  int64_t out_index;  // into the output array
  int64_t a_base, a_step, b_base, b_step, terms;
};

// result[i] = sum_t a[a_base + t*a_step] * b[b_base + t*b_step] in float64, and the output.
__global__ void spot_check_kernel(const __nv_bfloat16* __restrict__ a,
                                  const __nv_bfloat16* __restrict__ b,
                                  const __nv_bfloat16* __restrict__ out, const Sample* samples,
                                  int count, double* expected, double* got) {
  const int i = blockIdx.x;
  if (i >= count) return;
  const Sample s = samples[i];
  double acc = 0;
  for (int64_t t = threadIdx.x; t < s.terms; t += blockDim.x) {
    acc += static_cast<double>(__bfloat162float(a[s.a_base + t * s.a_step])) *
           static_cast<double>(__bfloat162float(b[s.b_base + t * s.b_step]));
  }
  __shared__ double partial[256];
  partial[threadIdx.x] = acc;
  __syncthreads();
  for (int w = blockDim.x / 2; w > 0; w >>= 1) {
    if (threadIdx.x < w) partial[threadIdx.x] += partial[threadIdx.x + w];
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    expected[i] = partial[0];
    got[i] = __bfloat162float(out[s.out_index]);
  }
}

// ----- host side -------------------------------------------------------------------------

// The product `op` of a case on buffers lhs [M,K], rhs [G*K*N], ct [M,N].
GroupedGemmParams op_params(Op op, const BenchCase& bc, const void* lhs, const void* rhs,
                            const void* ct, void* out, const int32_t* sizes) {
  GroupedGemmParams p{};
  p.in_dtype = p.out_dtype = DType::kBF16;
  p.group_sizes = sizes;
  p.m = bc.m;
  p.num_groups = bc.g;
  p.out = out;
  switch (op) {
    case Op::kFwd:
    case Op::kFwdT:
      p.layout = op == Op::kFwd ? GroupedLayout::kGmm : GroupedLayout::kGmmTransposed;
      p.lhs = lhs;
      p.rhs = rhs;  // read as [G,K,N] (fwd) or [G,N,K] (fwd_t): random data either way
      p.k = bc.k;
      p.n = bc.n;
      break;
    case Op::kDlhs:
      p.layout = GroupedLayout::kGmmTransposed;
      p.lhs = ct;
      p.rhs = rhs;  // [G,K,N] = [G, n, k] of this product
      p.k = bc.n;
      p.n = bc.k;
      break;
    case Op::kDrhs:
      p.layout = GroupedLayout::kTgmm;
      p.lhs = lhs;
      p.rhs = ct;
      p.k = bc.k;
      p.n = bc.n;
      break;
  }
  return p;
}

struct DeviceBuffer {
  void* ptr = nullptr;
  explicit DeviceBuffer(size_t bytes) { CHECK_CUDA(cudaMalloc(&ptr, std::max<size_t>(bytes, 1))); }
  ~DeviceBuffer() { cudaFree(ptr); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  template <typename T>
  T* as() const {
    return static_cast<T*>(ptr);
  }
};

struct Variant {
  GroupedGemmConfig config;
  std::string label;
};

std::string team_label(const GroupedGemmConfig& c) {
  return "team=" + moe_xla::cuda::grouped_gemm_team_name(c);
}

// Every CUTLASS path x {along M, along N} (team size as the heuristic picks it), or with
// --teams the default path and raster order of each case x team sizes.
std::vector<Variant> make_variants(bool teams) {
  std::vector<Variant> v;
  if (teams) {
    GroupedGemmConfig c;
    c.team_clusters = moe_xla::cuda::kTeamWholeGrid;
    c.team_waves = 1;
    v.push_back({c, team_label(c)});
    for (int32_t clusters : {4, 8, 16, 33}) {
      for (int32_t waves : {4, 8, 16}) {
        c.team_clusters = clusters;
        c.team_waves = waves;
        v.push_back({c, team_label(c)});
      }
    }
    return v;
  }
  for (GroupedGemmPath path : moe_xla::cuda::kGroupedGemmPaths) {
    if (path == GroupedGemmPath::kFallback) continue;  // SIMT: minutes per case, not a candidate
    std::string name = moe_xla::cuda::grouped_gemm_path_name(path);
    if (name.rfind("cutlass_", 0) != 0) {  // ours: no raster order to choose
      GroupedGemmConfig c;
      c.path = path;
      v.push_back({c, name});
      continue;
    }
    name = name.substr(8);
    for (GroupedGemmRaster raster : {GroupedGemmRaster::kAlongM, GroupedGemmRaster::kAlongN}) {
      GroupedGemmConfig c;
      c.path = path;
      c.raster = raster;
      v.push_back({c, name + (raster == GroupedGemmRaster::kAlongM ? "/M" : "/N")});
    }
  }
  return v;
}

bool same_config(const GroupedGemmConfig& a, const GroupedGemmConfig& b) {
  return a.path == b.path && a.raster == b.raster && a.team_clusters == b.team_clusters &&
         a.team_waves == b.team_waves;
}

constexpr double kNotRun = -1;    // not eligible / filtered out
constexpr double kFailed = -2;    // error, or output differs from the default
struct Cell {
  double tflops = kNotRun;
  double rel_err = 0;
  std::string why;
};

struct Options {
  int reps = 20;
  int warmup = 2;
  int sustain_ms = 0;  // back-to-back calls before the timed ones, to time a hot GPU
  bool check = true;
  std::vector<std::string> cases;
  std::vector<std::string> ops;
};

// --case: substring match; --op: exact names ("fwd" must not select "fwd_t").
bool case_selected(const Options& opt, const std::string& name_and_groups) {
  if (opt.cases.empty()) return true;
  for (const std::string& f : opt.cases) {
    if (name_and_groups.find(f) != std::string::npos) return true;
  }
  return false;
}

bool op_selected(const Options& opt, int op) {
  if (opt.ops.empty()) return true;
  for (const std::string& name : opt.ops) {
    if (name == kOpNames[op]) return true;
  }
  return false;
}

struct Bench {
  Options opt;
  int sm_count = 0;
  cudaStream_t stream = nullptr;
  std::vector<Variant> variants;
  // results[op][variant][case]; auto_variant[op][case] = index of the default's variant.
  std::vector<std::vector<std::vector<Cell>>> results;
  std::vector<std::vector<int>> auto_variant;
  std::vector<std::vector<double>> auto_tflops;
  std::vector<int> done_cases;  // started so far, for partial results after a fatal error
  int failures = 0;

  // Median milliseconds of `reps` calls, or a negative value if a call failed.
  double time_ms(const GroupedGemmParams& p, const GroupedGemmConfig& config, void* ws,
                 size_t ws_bytes, std::string* why) {
    // Untimed calls: --warmup of them, and more until --sustain-ms has passed (keeps the GPU
    // busy with this variant so clock and power settle under load); the stream is
    // synchronised every 16 calls to bound the queue.
    const auto hot_until =
        std::chrono::steady_clock::now() + std::chrono::milliseconds(opt.sustain_ms);
    for (int i = 0; i < opt.warmup || std::chrono::steady_clock::now() < hot_until; ++i) {
      const moe_xla::Status status =
          moe_xla::cuda::grouped_gemm(p, ws, ws_bytes, sm_count, stream, config);
      if (!status.ok()) {
        *why = status.message();
        return -1;
      }
      if (i % 16 == 15) CHECK_CUDA(cudaStreamSynchronize(stream));
    }
    std::vector<cudaEvent_t> start(opt.reps), stop(opt.reps);
    for (int r = 0; r < opt.reps; ++r) {
      CHECK_CUDA(cudaEventCreate(&start[r]));
      CHECK_CUDA(cudaEventCreate(&stop[r]));
    }
    std::string timed_error;
    for (int r = 0; r < opt.reps && timed_error.empty(); ++r) {
      CHECK_CUDA(cudaEventRecord(start[r], stream));
      timed_error = error_message(
          moe_xla::cuda::grouped_gemm(p, ws, ws_bytes, sm_count, stream, config));
      CHECK_CUDA(cudaEventRecord(stop[r], stream));
    }
    CHECK_CUDA(cudaStreamSynchronize(stream));
    if (!timed_error.empty()) {
      for (int r = 0; r < opt.reps; ++r) {
        CHECK_CUDA(cudaEventDestroy(start[r]));
        CHECK_CUDA(cudaEventDestroy(stop[r]));
      }
      *why = timed_error;
      return -1;
    }
    std::vector<float> ms(opt.reps);
    for (int r = 0; r < opt.reps; ++r) {
      CHECK_CUDA(cudaEventElapsedTime(&ms[r], start[r], stop[r]));
      CHECK_CUDA(cudaEventDestroy(start[r]));
      CHECK_CUDA(cudaEventDestroy(stop[r]));
    }
    std::sort(ms.begin(), ms.end());
    return opt.reps % 2 ? ms[opt.reps / 2] : 0.5 * (ms[opt.reps / 2 - 1] + ms[opt.reps / 2]);
  }

  // max |out - ref| / max |ref| over all elements; NaN output counts as a failure.
  Cell compare(const void* out, const void* ref, int64_t elems, CompareResult* d_result) {
    CHECK_CUDA(cudaMemsetAsync(d_result, 0, sizeof(CompareResult), stream));
    const int blocks = static_cast<int>(std::min<int64_t>((elems + 255) / 256, 8 * sm_count));
    compare_kernel<<<blocks, 256, 0, stream>>>(static_cast<const __nv_bfloat16*>(out),
                                               static_cast<const __nv_bfloat16*>(ref), elems,
                                               d_result);
    CHECK_CUDA(cudaGetLastError());
    CompareResult r{};
    CHECK_CUDA(cudaMemcpyAsync(&r, d_result, sizeof(r), cudaMemcpyDeviceToHost, stream));
    CHECK_CUDA(cudaStreamSynchronize(stream));
    Cell c;
    float max_diff, max_ref;
    std::memcpy(&max_diff, &r.max_diff_bits, 4);
    std::memcpy(&max_ref, &r.max_ref_bits, 4);
    c.rel_err = max_ref > 0 ? max_diff / max_ref : max_diff;
    if (r.nan_count) {
      c.tflops = kFailed;
      c.why = std::to_string(r.nan_count) + " non-finite outputs";
    } else if (!(c.rel_err < 1e-2)) {
      c.tflops = kFailed;
      c.why = "max|diff|/max|ref| = " + std::to_string(c.rel_err);
    }
    return c;
  }

  // Spot check of the default output: 256 elements against float64 dot products.
  // Returns max |got - expected| / max |expected| over the samples.
  double spot_check(Op op, const BenchCase& bc, const GroupedGemmParams& p,
                    const std::vector<int64_t>& offsets) {
    constexpr int kSamples = 256;
    std::vector<Sample> samples;
    uint64_t state = 0x5eed0000 + static_cast<uint64_t>(op);
    auto next = [&](int64_t bound) {  // xorshift64*, uniform enough for picking samples
      state ^= state >> 12;
      state ^= state << 25;
      state ^= state >> 27;
      return static_cast<int64_t>((state * 2685821657736338717ull) >> 11) % bound;
    };
    const int64_t k = p.k, n = p.n;
    while (static_cast<int>(samples.size()) < kSamples) {
      const int64_t g = next(bc.g);
      const int64_t rows = offsets[g + 1] - offsets[g];
      if (rows == 0) continue;
      Sample s{};
      if (op == Op::kDrhs) {  // out[g, i, j] = sum_r lhs[r, i] * rhs[r, j]
        const int64_t i = next(k), j = next(n);
        s.out_index = (g * k + i) * n + j;
        s.a_base = offsets[g] * k + i;
        s.a_step = k;
        s.b_base = offsets[g] * n + j;
        s.b_step = n;
        s.terms = rows;
      } else {  // out[r, j] = sum_t lhs[r, t] * B_g[t, j]
        const int64_t r = offsets[g] + next(rows), j = next(n);
        s.out_index = r * n + j;
        s.a_base = r * k;
        s.a_step = 1;
        if (op == Op::kFwd) {  // rhs [G, K, N]
          s.b_base = g * k * n + j;
          s.b_step = n;
        } else {  // rhs [G, N, K]
          s.b_base = (g * n + j) * k;
          s.b_step = 1;
        }
        s.terms = k;
      }
      samples.push_back(s);
    }
    DeviceBuffer d_samples(kSamples * sizeof(Sample)), d_expected(kSamples * sizeof(double)),
        d_got(kSamples * sizeof(double));
    CHECK_CUDA(cudaMemcpyAsync(d_samples.ptr, samples.data(), kSamples * sizeof(Sample),
                               cudaMemcpyHostToDevice, stream));
    spot_check_kernel<<<kSamples, 256, 0, stream>>>(
        static_cast<const __nv_bfloat16*>(p.lhs), static_cast<const __nv_bfloat16*>(p.rhs),
        static_cast<const __nv_bfloat16*>(p.out), d_samples.as<Sample>(), kSamples,
        d_expected.as<double>(), d_got.as<double>());
    CHECK_CUDA(cudaGetLastError());
    std::vector<double> expected(kSamples), got(kSamples);
    CHECK_CUDA(cudaMemcpyAsync(expected.data(), d_expected.ptr, kSamples * sizeof(double),
                               cudaMemcpyDeviceToHost, stream));
    CHECK_CUDA(cudaMemcpyAsync(got.data(), d_got.ptr, kSamples * sizeof(double),
                               cudaMemcpyDeviceToHost, stream));
    CHECK_CUDA(cudaStreamSynchronize(stream));
    double max_err = 0, max_ref = 0;
    for (int i = 0; i < kSamples; ++i) {
      if (!std::isfinite(got[i])) return INFINITY;
      max_err = std::max(max_err, std::fabs(got[i] - expected[i]));
      max_ref = std::max(max_ref, std::fabs(expected[i]));
    }
    return max_ref > 0 ? max_err / max_ref : max_err;
  }

  void run_case(int ci, const BenchCase& bc) {
    done_cases.push_back(ci);
    const int64_t M = bc.m, G = bc.g, K = bc.k, N = bc.n;
    int64_t total = 0;
    std::vector<int64_t> offsets(G + 1, 0);
    for (int64_t g = 0; g < G; ++g) {
      total += bc.sizes[g];
      offsets[g + 1] = total;
    }
    if (static_cast<int64_t>(bc.sizes.size()) != G || total != M) {
      std::printf("BAD CASE %s %s: group sizes do not sum to M\n", bc.name, bc.groups);
      ++failures;
      return;
    }
    const auto t0 = std::chrono::steady_clock::now();
    const size_t es = sizeof(__nv_bfloat16);
    DeviceBuffer lhs(M * K * es), rhs(G * K * N * es), ct(M * N * es);
    const int64_t out_elems = std::max({M * N, M * K, G * K * N});
    DeviceBuffer out(out_elems * es), ref(out_elems * es), sizes(G * sizeof(int32_t));
    DeviceBuffer cmp(sizeof(CompareResult));
    CHECK_CUDA(cudaMemcpyAsync(sizes.ptr, bc.sizes.data(), G * sizeof(int32_t),
                               cudaMemcpyHostToDevice, stream));
    const int fill_blocks = 16 * sm_count;
    // As benchmarks/gmm.py: lhs ~ N(0, 1), rhs ~ N(0, 1/K); cotangent ~ N(0, 1).
    fill_normal_kernel<<<fill_blocks, 256, 0, stream>>>(lhs.as<__nv_bfloat16>(), M * K, 1 + ci,
                                                        1.0f);
    fill_normal_kernel<<<fill_blocks, 256, 0, stream>>>(rhs.as<__nv_bfloat16>(), G * K * N,
                                                        101 + ci, 1.0f / std::sqrt(float(K)));
    fill_normal_kernel<<<fill_blocks, 256, 0, stream>>>(ct.as<__nv_bfloat16>(), M * N, 201 + ci,
                                                        1.0f);
    CHECK_CUDA(cudaGetLastError());
    const size_t ws_bytes = moe_xla::cuda::grouped_gemm_workspace_bytes_bound(M, G, sm_count);
    DeviceBuffer ws(ws_bytes);

    for (int oi = 0; oi < kNumOps; ++oi) {
      const Op op = static_cast<Op>(oi);
      if (!op_selected(opt, oi)) continue;
      const GroupedGemmParams p =
          op_params(op, bc, lhs.ptr, rhs.ptr, ct.ptr, out.ptr, sizes.as<int32_t>());
      const int64_t elems = p.layout == GroupedLayout::kTgmm ? G * p.k * p.n : M * p.n;
      const double flops = 2.0 * M * K * N;

      // Default configuration: reference output and its own spot check.
      const GroupedGemmConfig auto_config = moe_xla::cuda::grouped_gemm_select_config(p, sm_count);
      int auto_index = -1;
      for (size_t vi = 0; vi < variants.size(); ++vi) {
        const GroupedGemmConfig resolved =
            moe_xla::cuda::grouped_gemm_select_config(p, sm_count, variants[vi].config);
        if (same_config(resolved, auto_config)) auto_index = static_cast<int>(vi);
      }
      auto_variant[oi][ci] = auto_index;
      {
        GroupedGemmParams pr = p;
        pr.out = ref.ptr;
        const moe_xla::Status status =
            moe_xla::cuda::grouped_gemm(pr, ws.ptr, ws_bytes, sm_count, stream, auto_config);
        if (!status.ok()) {
          std::printf("FAIL %s %s %s: default configuration: %s\n", bc.name, bc.groups,
                      kOpNames[oi], status.message().c_str());
          ++failures;
          continue;
        }
        CHECK_CUDA(cudaStreamSynchronize(stream));
        if (opt.check) {
          const double err = spot_check(op, bc, pr, offsets);
          if (!(err < 1e-2)) {
            std::printf("FAIL %s %s %s: default output vs float64 spot check: rel err %.3e\n",
                        bc.name, bc.groups, kOpNames[oi], err);
            ++failures;
          }
        }
        std::string why;
        const double ms = time_ms(pr, auto_config, ws.ptr, ws_bytes, &why);
        auto_tflops[oi][ci] = ms > 0 ? flops / (ms * 1e-3) / 1e12 : kFailed;
      }

      for (size_t vi = 0; vi < variants.size(); ++vi) {
        Cell& cell = results[oi][vi][ci];
        const GroupedGemmConfig& config = variants[vi].config;
        if (!moe_xla::cuda::grouped_gemm_path_supported(p, config.path)) continue;
        if (static_cast<int>(vi) == auto_index) {  // already timed above
          cell.tflops = auto_tflops[oi][ci];
          continue;
        }
        if (opt.check) {
          CHECK_CUDA(cudaMemsetAsync(out.ptr, 0xFF, elems * es, stream));  // NaN
          const moe_xla::Status status =
              moe_xla::cuda::grouped_gemm(p, ws.ptr, ws_bytes, sm_count, stream, config);
          if (!status.ok()) {
            cell.tflops = kFailed;
            cell.why = status.message();
          } else {
            const cudaError_t e = cudaStreamSynchronize(stream);
            if (e != cudaSuccess) {
              std::printf("FATAL %s %s %s %s: CUDA error %s (device state is lost; results "
                          "so far follow)\n",
                          bc.name, bc.groups, kOpNames[oi], variants[vi].label.c_str(),
                          cudaGetErrorString(e));
              print_tables(done_cases);
              print_summary(done_cases);
              std::exit(2);
            }
            cell = compare(out.ptr, ref.ptr, elems, cmp.as<CompareResult>());
          }
          if (cell.tflops == kFailed) {
            std::printf("FAIL %s %s %s %s: %s\n", bc.name, bc.groups, kOpNames[oi],
                        variants[vi].label.c_str(), cell.why.c_str());
            ++failures;
            continue;
          }
        }
        std::string why;
        const double ms = time_ms(p, config, ws.ptr, ws_bytes, &why);
        if (ms <= 0) {
          cell.tflops = kFailed;
          std::printf("FAIL %s %s %s %s: %s\n", bc.name, bc.groups, kOpNames[oi],
                      variants[vi].label.c_str(), why.c_str());
          ++failures;
          continue;
        }
        cell.tflops = flops / (ms * 1e-3) / 1e12;
      }

      // One progress line per case and product.
      int best = -1;
      for (size_t vi = 0; vi < variants.size(); ++vi) {
        if (results[oi][vi][ci].tflops > 0 &&
            (best < 0 || results[oi][vi][ci].tflops > results[oi][best][ci].tflops)) {
          best = static_cast<int>(vi);
        }
      }
      const double auto_tf = auto_tflops[oi][ci];
      std::printf("%-10s %-5s default %-26s %6.1f | best %-26s %6.1f (%.3fx)\n",
                  short_case_name(bc).c_str(), kOpNames[oi],
                  auto_index >= 0 ? variants[auto_index].label.c_str() : "?", auto_tf,
                  best >= 0 ? variants[best].label.c_str() : "-",
                  best >= 0 ? results[oi][best][ci].tflops : 0.0,
                  best >= 0 && auto_tf > 0 ? results[oi][best][ci].tflops / auto_tf : 0.0);
      std::fflush(stdout);
    }
    const double secs =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::printf("  (%s %s: M=%lld G=%lld K=%lld N=%lld, %.1f s)\n", bc.name, bc.groups,
                (long long)M, (long long)G, (long long)K, (long long)N, secs);
    std::fflush(stdout);
  }

  // --list: what a run would do, without a GPU (sm_count from --sm-count).
  void list(const std::vector<int>& case_ids) {
    double total_ms = 0;
    alignas(256) static char fake[256];  // 16-byte aligned stand-in pointers (never read)
    for (int ci : case_ids) {
      const BenchCase& bc = kCases[ci];
      int64_t sum = 0;
      for (int32_t v : bc.sizes) sum += v;
      std::printf("%-10s %s %s M=%lld G=%lld K=%lld N=%lld sum(sizes)=%lld%s\n",
                  short_case_name(bc).c_str(), bc.name, bc.groups, (long long)bc.m,
                  (long long)bc.g, (long long)bc.k, (long long)bc.n, (long long)sum,
                  sum == bc.m && static_cast<int64_t>(bc.sizes.size()) == bc.g ? "" : "  BAD");
      for (int oi = 0; oi < kNumOps; ++oi) {
        if (!op_selected(opt, oi)) continue;
        const GroupedGemmParams p = op_params(static_cast<Op>(oi), bc, fake, fake, fake, fake,
                                              reinterpret_cast<const int32_t*>(fake));
        const GroupedGemmConfig c = moe_xla::cuda::grouped_gemm_select_config(p, sm_count);
        int eligible = 0;
        for (const Variant& v : variants) {
          eligible += moe_xla::cuda::grouped_gemm_path_supported(p, v.config.path) ? 1 : 0;
        }
        // Calls per variant: check + warmup + reps; the default once more for the reference.
        const double ms_at_600 = 2.0 * bc.m * bc.k * bc.n / 600e12 * 1e3;
        total_ms += ms_at_600 * ((eligible + 1) * (1 + opt.warmup + opt.reps)) +
                    (eligible + 1) * static_cast<double>(opt.sustain_ms);
        std::printf("    %-5s m=%lld k=%lld n=%lld  default %s/%s/%s, %d variants\n",
                    kOpNames[oi], (long long)p.m, (long long)p.k, (long long)p.n,
                    moe_xla::cuda::grouped_gemm_path_name(c.path),
                    moe_xla::cuda::grouped_gemm_raster_name(c.raster), team_label(c).c_str(),
                    eligible);
      }
    }
    std::printf("estimated GPU time at 600 TFLOP/s: %.0f s\n", total_ms * 1e-3);
  }

  void print_tables(const std::vector<int>& case_ids) {
    for (int oi = 0; oi < kNumOps; ++oi) {
      if (!op_selected(opt, oi)) continue;
      std::printf("\n== %s TFLOP/s (median of %d; * = current default, + = best of the "
                  "column, x = failed check, - = not eligible)\n",
                  kOpNames[oi], opt.reps);
      std::printf("%-26s", "variant");
      for (int ci : case_ids) std::printf(" %10s", short_case_name(kCases[ci]).c_str());
      std::printf("\n");
      for (size_t vi = 0; vi < variants.size(); ++vi) {
        std::printf("%-26s", variants[vi].label.c_str());
        for (int ci : case_ids) {
          const Cell& c = results[oi][vi][ci];
          if (c.tflops == kNotRun) {
            std::printf(" %10s", "-");
          } else if (c.tflops == kFailed) {
            std::printf(" %10s", "x");
          } else {
            double best = 0;
            for (size_t vj = 0; vj < variants.size(); ++vj) {
              best = std::max(best, results[oi][vj][ci].tflops);
            }
            const bool is_auto = auto_variant[oi][ci] == static_cast<int>(vi);
            const bool is_best = c.tflops == best;
            std::printf(" %9.1f%c", c.tflops, is_auto ? '*' : (is_best ? '+' : ' '));
          }
        }
        std::printf("\n");
      }
    }
  }

  void print_summary(const std::vector<int>& case_ids) {
    std::printf("\n== best variant per case and product (speed-up over the current default)\n");
    for (int oi = 0; oi < kNumOps; ++oi) {
      if (!op_selected(opt, oi)) continue;
      for (int ci : case_ids) {
        int best = -1;
        for (size_t vi = 0; vi < variants.size(); ++vi) {
          if (results[oi][vi][ci].tflops > 0 &&
              (best < 0 || results[oi][vi][ci].tflops > results[oi][best][ci].tflops)) {
            best = static_cast<int>(vi);
          }
        }
        if (best < 0) continue;
        const double tf = results[oi][best][ci].tflops, auto_tf = auto_tflops[oi][ci];
        std::printf("BEST %-5s %-10s %-26s %6.1f TFLOP/s  %.3fx default", kOpNames[oi],
                    short_case_name(kCases[ci]).c_str(), variants[best].label.c_str(), tf,
                    auto_tf > 0 ? tf / auto_tf : 0.0);
        std::printf("\n");
      }
    }
    std::printf("\n== per product: geometric mean over the cases of variant / default "
                "(cases where the variant ran; n = their count)\n");
    for (int oi = 0; oi < kNumOps; ++oi) {
      if (!op_selected(opt, oi)) continue;
      std::vector<std::pair<double, int>> ranked;
      std::vector<int> counts(variants.size(), 0);
      for (size_t vi = 0; vi < variants.size(); ++vi) {
        double log_sum = 0;
        int count = 0;
        for (int ci : case_ids) {
          const double tf = results[oi][vi][ci].tflops, auto_tf = auto_tflops[oi][ci];
          if (tf > 0 && auto_tf > 0) {
            log_sum += std::log(tf / auto_tf);
            ++count;
          }
        }
        counts[vi] = count;
        if (count) ranked.push_back({std::exp(log_sum / count), static_cast<int>(vi)});
      }
      std::sort(ranked.rbegin(), ranked.rend());
      std::printf("%-5s", kOpNames[oi]);
      for (size_t r = 0; r < ranked.size(); ++r) {
        std::printf("%s %s %.3f (n=%d)", r ? "," : "", variants[ranked[r].second].label.c_str(),
                    ranked[r].first, counts[ranked[r].second]);
        if (r % 3 == 2 && r + 1 < ranked.size()) std::printf("\n     ");
      }
      std::printf("\n");
    }
  }
};

int parse_int(const char* s, const char* flag) {
  char* end = nullptr;
  const long v = std::strtol(s, &end, 10);
  if (end == s || *end != '\0' || v <= 0 || v > 100000) {
    std::fprintf(stderr, "%s expects a positive integer, got '%s'\n", flag, s);
    std::exit(2);
  }
  return static_cast<int>(v);
}

}  // namespace

int main(int argc, char** argv) {
  Bench bench;
  bool list_only = false, teams = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> const char* {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "%s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--reps") {
      bench.opt.reps = parse_int(value(), "--reps");
    } else if (a == "--warmup") {
      bench.opt.warmup = parse_int(value(), "--warmup");
    } else if (a == "--sustain-ms") {
      bench.opt.sustain_ms = parse_int(value(), "--sustain-ms");
    } else if (a == "--case") {
      bench.opt.cases.push_back(value());
    } else if (a == "--op") {
      bench.opt.ops.push_back(value());
    } else if (a == "--no-check") {
      bench.opt.check = false;
    } else if (a == "--teams") {
      teams = true;
    } else if (a == "--list") {
      list_only = true;
    } else if (a == "--sm-count") {
      bench.sm_count = parse_int(value(), "--sm-count");
    } else {
      std::fprintf(stderr,
                   "usage: %s [--reps N] [--warmup N] [--sustain-ms N] [--case SUBSTR]... [--op NAME]... "
                   "[--no-check] [--teams] [--list [--sm-count N]]\n",
                   argv[0]);
      return 2;
    }
  }
  for (const std::string& op : bench.opt.ops) {
    if (op != "fwd" && op != "fwd_t" && op != "dlhs" && op != "drhs") {
      std::fprintf(stderr, "--op: expected fwd, fwd_t, dlhs or drhs, got '%s'\n", op.c_str());
      return 2;
    }
  }
  bench.variants = make_variants(teams);
  constexpr int kNumCases = static_cast<int>(sizeof(kCases) / sizeof(kCases[0]));
  std::vector<int> case_ids;
  for (int ci = 0; ci < kNumCases; ++ci) {
    if (case_selected(bench.opt, std::string(kCases[ci].name) + " " + kCases[ci].groups)) {
      case_ids.push_back(ci);
    }
  }
  if (list_only) {
    if (bench.sm_count == 0) bench.sm_count = 132;  // H100 SXM / H200
    bench.list(case_ids);
    return 0;
  }

  int device = 0;
  CHECK_CUDA(cudaGetDevice(&device));
  CHECK_CUDA(cudaDeviceGetAttribute(&bench.sm_count, cudaDevAttrMultiProcessorCount, device));
  cudaDeviceProp prop{};
  CHECK_CUDA(cudaGetDeviceProperties(&prop, device));
  int driver = 0, runtime = 0;
  CHECK_CUDA(cudaDriverGetVersion(&driver));
  CHECK_CUDA(cudaRuntimeGetVersion(&runtime));
  std::printf("device %d: %s (sm_%d%d, %d SMs), driver %d, runtime %d\n", device, prop.name,
              prop.major, prop.minor, bench.sm_count, driver, runtime);
  CHECK_CUDA(cudaStreamCreateWithFlags(&bench.stream, cudaStreamNonBlocking));

  bench.results.assign(kNumOps, std::vector<std::vector<Cell>>(bench.variants.size(),
                                                              std::vector<Cell>(kNumCases)));
  bench.auto_variant.assign(kNumOps, std::vector<int>(kNumCases, -1));
  bench.auto_tflops.assign(kNumOps, std::vector<double>(kNumCases, kNotRun));
  std::printf("variants:");
  for (const Variant& v : bench.variants) std::printf(" %s", v.label.c_str());
  std::printf("\nreps %d (median), warmup %d, sustain %d ms, checks %s\n\n", bench.opt.reps,
              bench.opt.warmup, bench.opt.sustain_ms, bench.opt.check ? "on" : "off");

  const auto t0 = std::chrono::steady_clock::now();
  for (int ci : case_ids) bench.run_case(ci, kCases[ci]);
  bench.print_tables(case_ids);
  bench.print_summary(case_ids);
  const double secs =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("\n%s: %d failed checks, %.1f s\n", bench.failures ? "FAILED" : "OK",
              bench.failures, secs);
  CHECK_CUDA(cudaStreamDestroy(bench.stream));
  return bench.failures ? 1 : 0;
}
