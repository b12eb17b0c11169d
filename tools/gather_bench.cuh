// What the gather benchmarks (gather_gemm_bench.cu, gather_tgmm_bench.cu) share: the
// routed first-GEMM cases, their routing, random inputs, the row-gather kernel of the path
// they replace, the routing on the device, the params of both paths, the check of two outputs, the command line, the
// timing of two paths and the printed table.
// Included by one translation unit per program.
#ifndef MOE_XLA_TOOLS_GATHER_BENCH_CUH_
#define MOE_XLA_TOOLS_GATHER_BENCH_CUH_

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "common/grouped_gemm.h"
#include "common/status.h"
#include "tools/cuda_check.h"

namespace gather_bench {

// A routed first expert GEMM: T tokens of width K, each routed to top_k of G experts
// (M = T * top_k rows), N the width of the product.
struct GatherCase {
  const char* name;
  int64_t tokens, k, n, g, top_k;
};

// The gate_up cases of benchmarks/cases.json (T = M / top_k of the model's moe_layer
// entry) and its sonicmoe cases (K = H, N = 2F, G = E); bench_cases.py --gather writes them
// into gather_bench_cases.inc at build time.
const GatherCase kCases[] = {
#include "tools/gather_bench_cases.inc"
};

// Uniform bf16 values in [-1, 1) from a counter-based hash.
__global__ void fill_uniform_kernel(__nv_bfloat16* out, int64_t n, uint64_t seed) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    uint64_t h = seed * 0x9E3779B97F4A7C15ull + static_cast<uint64_t>(i);
    h = (h ^ (h >> 30)) * 0xBF58476D1CE4E5B9ull;
    h = (h ^ (h >> 27)) * 0x94D049BB133111EBull;
    h ^= h >> 31;
    out[i] = __float2bfloat16_rn(static_cast<float>(h >> 40) * (2.0f / 16777216.0f) - 1.0f);
  }
}

inline void fill_uniform(__nv_bfloat16* out, int64_t n, uint64_t seed, cudaStream_t stream) {
  fill_uniform_kernel<<<1024, 256, 0, stream>>>(out, n, seed);
  CHECK_CUDA(cudaGetLastError());
}

// x_sorted[r] = x[src[r]] (zero for src outside [0, T)), in 16-byte vectors (k % 8 == 0).
__global__ void gather_rows_kernel(const uint4* __restrict__ x, const int32_t* __restrict__ src,
                                   uint4* __restrict__ x_sorted, int64_t tokens, int64_t m,
                                   int64_t row_vecs) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < m * row_vecs;
       i += stride) {
    const int64_t r = i / row_vecs;
    const int32_t s = src[r];
    x_sorted[i] = s >= 0 && s < tokens ? x[s * row_vecs + i % row_vecs] : uint4{0u, 0u, 0u, 0u};
  }
}

// Enqueues gather_rows_kernel for the rows x [tokens, k] bf16 -> x_sorted [m, k].
inline void gather_rows(const __nv_bfloat16* x, const int32_t* src, __nv_bfloat16* x_sorted, int64_t tokens,
                        int64_t m, int64_t k, int sm_count, cudaStream_t stream) {
  const int64_t row_vecs = k / 8;
  const int64_t blocks = std::max<int64_t>(std::min<int64_t>((m * row_vecs + 255) / 256, 8 * int64_t{sm_count}), 1);
  gather_rows_kernel<<<static_cast<unsigned>(blocks), 256, 0, stream>>>(
      reinterpret_cast<const uint4*>(x), src, reinterpret_cast<uint4*>(x_sorted), tokens, m, row_vecs);
  CHECK_CUDA(cudaGetLastError());
}

// max |a - b| / max |b| over a sample of whole rows (about 4096, evenly spaced) of the two
// [rows, n] bf16 outputs, copied to the host; NaN or infinity anywhere in them fails.
inline bool outputs_agree(const __nv_bfloat16* a, const __nv_bfloat16* b, int64_t rows, int64_t n,
                          std::string* detail) {
  const int64_t step = std::max<int64_t>(rows / 4096, 1);
  std::vector<__nv_bfloat16> row_a(static_cast<size_t>(n)), row_b(static_cast<size_t>(n));
  float max_diff = 0.f, max_ref = 0.f;
  for (int64_t r = 0; r < rows; r += step) {
    CHECK_CUDA(cudaMemcpy(row_a.data(), a + r * n, n * 2, cudaMemcpyDeviceToHost));
    CHECK_CUDA(cudaMemcpy(row_b.data(), b + r * n, n * 2, cudaMemcpyDeviceToHost));
    for (int64_t c = 0; c < n; ++c) {
      const float x = __bfloat162float(row_a[static_cast<size_t>(c)]);
      const float y = __bfloat162float(row_b[static_cast<size_t>(c)]);
      if (!std::isfinite(x) || !std::isfinite(y)) {
        *detail = "FAIL (not finite at row " + std::to_string(r) + ")";
        return false;
      }
      max_diff = std::max(max_diff, std::fabs(x - y));
      max_ref = std::max(max_ref, std::fabs(y));
    }
  }
  const bool ok = max_diff <= 1e-2f * max_ref;
  *detail = ok ? "ok" : "FAIL (max diff " + std::to_string(max_diff) + ", max ref " +
                            std::to_string(max_ref) + ")";
  return ok;
}

// Each token picks top_k distinct experts uniformly; assignments sorted by expert, then
// token: src[slot] = token, sizes[e] = tokens routed to e.
inline void route(const GatherCase& c, std::vector<int32_t>* src, std::vector<int32_t>* sizes) {
  std::mt19937_64 rng(7);
  std::uniform_int_distribution<int64_t> expert(0, c.g - 1);
  std::vector<std::vector<int32_t>> per_expert(static_cast<size_t>(c.g));
  std::vector<int64_t> picked;
  for (int64_t t = 0; t < c.tokens; ++t) {
    picked.clear();
    while (static_cast<int64_t>(picked.size()) < c.top_k) {
      const int64_t e = expert(rng);
      if (std::find(picked.begin(), picked.end(), e) == picked.end()) picked.push_back(e);
    }
    for (int64_t e : picked) per_expert[static_cast<size_t>(e)].push_back(static_cast<int32_t>(t));
  }
  src->clear();
  sizes->clear();
  for (const auto& tokens : per_expert) {
    src->insert(src->end(), tokens.begin(), tokens.end());
    sizes->push_back(static_cast<int32_t>(tokens.size()));
  }
}

// A case's routing (route) on the device: src [M] and group_sizes [G], freed with it.
struct DeviceRouting {
  int64_t m;
  int32_t *src, *sizes;

  explicit DeviceRouting(const GatherCase& c) : m(c.tokens * c.top_k) {
    std::vector<int32_t> host_src, host_sizes;
    route(c, &host_src, &host_sizes);
    CHECK_CUDA(cudaMalloc(&src, m * 4));
    CHECK_CUDA(cudaMalloc(&sizes, c.g * 4));
    CHECK_CUDA(cudaMemcpy(src, host_src.data(), m * 4, cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMemcpy(sizes, host_sizes.data(), c.g * 4, cudaMemcpyHostToDevice));
  }
  ~DeviceRouting() {
    CHECK_CUDA(cudaFree(src));
    CHECK_CUDA(cudaFree(sizes));
  }
  DeviceRouting(const DeviceRouting&) = delete;
  DeviceRouting& operator=(const DeviceRouting&) = delete;
};

// The params of a gather product (moe_xla::GatherGemmParams or GatherTgmmParams, whose
// shared fields have the same names) with bf16 input and output; the caller sets the
// second operand (w or dy).
template <class Params>
Params gather_params(const void* x, const int32_t* src, const int32_t* group_sizes, void* out,
                     int64_t tokens, int64_t m, int64_t k, int64_t n, int64_t num_groups) {
  Params p{};
  p.in_dtype = p.out_dtype = moe_xla::DType::kBF16;
  p.x = x;
  p.src = src;
  p.group_sizes = group_sizes;
  p.out = out;
  p.tokens = tokens;
  p.m = m;
  p.k = k;
  p.n = n;
  p.num_groups = num_groups;
  return p;
}

// The params of the copy path's grouped GEMM (`layout` kGmm or kTgmm), bf16 input and
// output.
inline moe_xla::GroupedGemmParams grouped_params(moe_xla::GroupedLayout layout, const void* lhs,
                                                 const void* rhs, const int32_t* group_sizes,
                                                 void* out, int64_t m, int64_t k, int64_t n,
                                                 int64_t num_groups) {
  moe_xla::GroupedGemmParams p{};
  p.layout = layout;
  p.in_dtype = p.out_dtype = moe_xla::DType::kBF16;
  p.lhs = lhs;
  p.rhs = rhs;
  p.group_sizes = group_sizes;
  p.out = out;
  p.m = m;
  p.k = k;
  p.n = n;
  p.num_groups = num_groups;
  return p;
}

inline double median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

// Exits with status 2 and the message when a library call failed.
inline void check(const moe_xla::Status& s, const char* what) {
  if (s.ok()) return;
  std::fprintf(stderr, "%s failed: %s\n", what, s.message().c_str());
  std::exit(2);
}

// The command line: [--reps N] [--warmup N] [--case SUBSTR]...
struct Options {
  int reps = 20, warmup = 5;
  std::vector<std::string> filters;

  // Whether case c is selected (no --case: every case).
  bool selected(const GatherCase& c) const {
    return filters.empty() || std::any_of(filters.begin(), filters.end(), [&](const std::string& f) {
             return std::string(c.name).find(f) != std::string::npos;
           });
  }
};

// Parses the command line; prints the usage and exits with status 2 on anything else.
inline Options parse_options(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--reps" && i + 1 < argc) {
      o.reps = std::max(1, std::atoi(argv[++i]));
    } else if (arg == "--warmup" && i + 1 < argc) {
      o.warmup = std::max(0, std::atoi(argv[++i]));
    } else if (arg == "--case" && i + 1 < argc) {
      o.filters.push_back(argv[++i]);
    } else {
      std::fprintf(stderr, "usage: %s [--reps N] [--warmup N] [--case SUBSTR]...\n", argv[0]);
      std::exit(2);
    }
  }
  return o;
}

// Prints the device and the table header; returns the device's SM count.
inline int print_device(const Options& options) {
  int device = 0, sm_count = 0;
  CHECK_CUDA(cudaGetDevice(&device));
  CHECK_CUDA(cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, device));
  cudaDeviceProp prop{};
  CHECK_CUDA(cudaGetDeviceProperties(&prop, device));
  std::printf("device %d: %s (%d SMs); %d warm-up and %d timed rounds, medians\n", device,
              prop.name, sm_count, options.warmup, options.reps);
  std::printf("%-28s %6s %5s %5s %4s %3s | %9s %8s | %9s %8s | %6s %s\n", "case", "T", "K", "N",
              "G", "k", "gather ms", "TFLOP/s", "copy ms", "TFLOP/s", "ratio", "check");
  return sm_count;
}

// Prints a case's row: the median times of the two paths, their TFLOP/s (2 * M * K * N),
// the ratio copy / gather and the check's detail.
inline void print_row(const GatherCase& c, double ms_gather, double ms_copy, const std::string& detail) {
  const double flop = 2.0 * c.tokens * c.top_k * c.k * c.n;
  std::printf("%-28s %6lld %5lld %5lld %4lld %3lld | %9.3f %8.1f | %9.3f %8.1f | %6.3f %s\n", c.name,
              static_cast<long long>(c.tokens), static_cast<long long>(c.k),
              static_cast<long long>(c.n), static_cast<long long>(c.g),
              static_cast<long long>(c.top_k), ms_gather, flop / ms_gather * 1e-9, ms_copy,
              flop / ms_copy * 1e-9, ms_copy / ms_gather, detail.c_str());
}

// The median milliseconds of two paths on `stream`: `warmup` untimed rounds, then `reps`
// timed rounds, each timing a() then b() with one pair of CUDA events around each.
template <class A, class B>
void time_pair(const Options& o, cudaStream_t stream, A&& a, B&& b, double* ms_a, double* ms_b) {
  cudaEvent_t ev[3];
  for (auto& e : ev) CHECK_CUDA(cudaEventCreate(&e));
  for (int i = 0; i < o.warmup; ++i) {
    a();
    b();
  }
  std::vector<float> t_a, t_b;
  for (int i = 0; i < o.reps; ++i) {
    CHECK_CUDA(cudaEventRecord(ev[0], stream));
    a();
    CHECK_CUDA(cudaEventRecord(ev[1], stream));
    b();
    CHECK_CUDA(cudaEventRecord(ev[2], stream));
    CHECK_CUDA(cudaEventSynchronize(ev[2]));
    float x, y;
    CHECK_CUDA(cudaEventElapsedTime(&x, ev[0], ev[1]));
    CHECK_CUDA(cudaEventElapsedTime(&y, ev[1], ev[2]));
    t_a.push_back(x);
    t_b.push_back(y);
  }
  *ms_a = median(t_a);
  *ms_b = median(t_b);
  for (auto& e : ev) CHECK_CUDA(cudaEventDestroy(e));
}

}  // namespace gather_bench

#endif  // MOE_XLA_TOOLS_GATHER_BENCH_CUH_
