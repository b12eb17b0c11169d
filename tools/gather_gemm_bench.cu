// Benchmark of moe_xla::cuda::gather_gemm against the path it replaces, on the first expert
// GEMM of a MoE layer: the gate_up cases of benchmarks/cases.json (T = M / top_k of the
// model's moe_layer entry) and its sonicmoe cases (K = H, N = 2F, G = E); bench_cases.py
// --gather writes them into gather_bench_cases.inc at build time.
//
// For each case it routes T tokens to top_k distinct experts each, uniformly at random
// (balanced multinomial routing, fixed seed), sorts the M = T * top_k assignments by
// expert (stable in token order) into src [M] and group_sizes [G], and on the same random
// bf16 x [T, K] and w [G, K, N] on the device times
//   (a) gather:  gather_gemm(x, src, w, group_sizes) -> out [M, N]
//   (b) copy:    a gather kernel x_sorted[r] = x[src[r]] (16-byte vectors), then
//                grouped_gemm (kGmm, auto configuration) of x_sorted with w -> out [M, N]
// It checks once that the two outputs agree (max |a - b| / max |b| < 1e-2 on ~4096 rows,
// no NaN), then runs `--warmup` untimed rounds and `--reps` timed rounds, each round
// timing (a) then (b) with one pair of CUDA events around each, and reports the medians in
// ms, TFLOP/s (2 * M * K * N) and the ratio time(b) / time(a) (> 1: the gather GEMM is
// faster).
//
// Usage: gather_gemm_bench [--reps N] [--warmup N] [--case SUBSTR]...
// Exit status 1 if a check failed.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "common/gather_gemm.h"
#include "common/grouped_gemm.h"
#include "common/status.h"
#include "cuda/gather_gemm.h"
#include "cuda/grouped_gemm.h"
#include "tools/cuda_check.h"

namespace {

using moe_xla::DType;

struct GatherCase {
  const char* name;
  int64_t tokens, k, n, g, top_k;
};

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

// max |a - b| / max |b| over a sample of whole rows (about 4096, evenly spaced) of the two
// [m, n] bf16 outputs, copied to the host; NaN or infinity anywhere in them fails.
bool outputs_agree(const __nv_bfloat16* a, const __nv_bfloat16* b, int64_t m, int64_t n,
                   std::string* detail) {
  const int64_t step = std::max<int64_t>(m / 4096, 1);
  std::vector<__nv_bfloat16> row_a(static_cast<size_t>(n)), row_b(static_cast<size_t>(n));
  float max_diff = 0.f, max_ref = 0.f;
  for (int64_t r = 0; r < m; r += step) {
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
void route(const GatherCase& c, std::vector<int32_t>* src, std::vector<int32_t>* sizes) {
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

double median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

void check(const moe_xla::Status& s, const char* what) {
  if (s.ok()) return;
  std::fprintf(stderr, "%s failed: %s\n", what, s.message().c_str());
  std::exit(2);
}

}  // namespace

int main(int argc, char** argv) {
  int reps = 20, warmup = 5;
  std::vector<std::string> filters;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--reps" && i + 1 < argc) {
      reps = std::max(1, std::atoi(argv[++i]));
    } else if (arg == "--warmup" && i + 1 < argc) {
      warmup = std::max(0, std::atoi(argv[++i]));
    } else if (arg == "--case" && i + 1 < argc) {
      filters.push_back(argv[++i]);
    } else {
      std::fprintf(stderr, "usage: %s [--reps N] [--warmup N] [--case SUBSTR]...\n", argv[0]);
      return 2;
    }
  }
  exit_if_no_cuda_device("gather_gemm_bench");
  int device = 0, sm_count = 0;
  CHECK_CUDA(cudaGetDevice(&device));
  CHECK_CUDA(cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, device));
  cudaDeviceProp prop{};
  CHECK_CUDA(cudaGetDeviceProperties(&prop, device));
  std::printf("device %d: %s (%d SMs); %d warm-up and %d timed rounds, medians\n", device,
              prop.name, sm_count, warmup, reps);
  std::printf("%-28s %6s %5s %5s %4s %3s | %9s %8s | %9s %8s | %6s %s\n", "case", "T", "K", "N",
              "G", "k", "gather ms", "TFLOP/s", "copy ms", "TFLOP/s", "ratio", "check");
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaEvent_t ev[3];
  for (auto& e : ev) CHECK_CUDA(cudaEventCreate(&e));
  int failures = 0;

  for (const GatherCase& c : kCases) {
    if (!filters.empty() && std::none_of(filters.begin(), filters.end(), [&](const std::string& f) {
          return std::string(c.name).find(f) != std::string::npos;
        })) {
      continue;
    }
    const int64_t m = c.tokens * c.top_k;
    std::vector<int32_t> src, sizes;
    route(c, &src, &sizes);
    __nv_bfloat16 *x, *w, *x_sorted, *out_gather, *out_copy;
    int32_t *d_src, *d_sizes;
    CHECK_CUDA(cudaMalloc(&x, c.tokens * c.k * 2));
    CHECK_CUDA(cudaMalloc(&w, c.g * c.k * c.n * 2));
    CHECK_CUDA(cudaMalloc(&x_sorted, m * c.k * 2));
    CHECK_CUDA(cudaMalloc(&out_gather, m * c.n * 2));
    CHECK_CUDA(cudaMalloc(&out_copy, m * c.n * 2));
    CHECK_CUDA(cudaMalloc(&d_src, m * 4));
    CHECK_CUDA(cudaMalloc(&d_sizes, c.g * 4));
    CHECK_CUDA(cudaMemcpy(d_src, src.data(), m * 4, cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMemcpy(d_sizes, sizes.data(), c.g * 4, cudaMemcpyHostToDevice));
    fill_uniform_kernel<<<1024, 256, 0, stream>>>(x, c.tokens * c.k, 1);
    fill_uniform_kernel<<<1024, 256, 0, stream>>>(w, c.g * c.k * c.n, 2);
    CHECK_CUDA(cudaGetLastError());

    moe_xla::GatherGemmParams gp{};
    gp.in_dtype = gp.out_dtype = DType::kBF16;
    gp.x = x;
    gp.src = d_src;
    gp.w = w;
    gp.group_sizes = d_sizes;
    gp.out = out_gather;
    gp.tokens = c.tokens;
    gp.m = m;
    gp.k = c.k;
    gp.n = c.n;
    gp.num_groups = c.g;
    moe_xla::GroupedGemmParams mp{};
    mp.layout = moe_xla::GroupedLayout::kGmm;
    mp.in_dtype = mp.out_dtype = DType::kBF16;
    mp.lhs = x_sorted;
    mp.rhs = w;
    mp.group_sizes = d_sizes;
    mp.out = out_copy;
    mp.m = m;
    mp.k = c.k;
    mp.n = c.n;
    mp.num_groups = c.g;
    const size_t gather_ws_bytes = moe_xla::cuda::gather_gemm_workspace_bytes(gp);
    const size_t gemm_ws_bytes = moe_xla::cuda::grouped_gemm_workspace_bytes(mp, sm_count);
    void *gather_ws, *gemm_ws;
    CHECK_CUDA(cudaMalloc(&gather_ws, gather_ws_bytes));
    CHECK_CUDA(cudaMalloc(&gemm_ws, gemm_ws_bytes));

    auto run_gather = [&] { check(moe_xla::cuda::gather_gemm(gp, gather_ws, gather_ws_bytes, stream), "gather_gemm"); };
    auto run_copy = [&] {
      const int64_t row_vecs = c.k / 8;
      const int64_t blocks = std::min<int64_t>((m * row_vecs + 255) / 256, 8 * int64_t{sm_count});
      gather_rows_kernel<<<static_cast<unsigned>(blocks), 256, 0, stream>>>(
          reinterpret_cast<const uint4*>(x), d_src, reinterpret_cast<uint4*>(x_sorted), c.tokens, m,
          row_vecs);
      CHECK_CUDA(cudaGetLastError());
      check(moe_xla::cuda::grouped_gemm(mp, gemm_ws, gemm_ws_bytes, sm_count, stream), "grouped_gemm");
    };

    run_gather();
    run_copy();
    CHECK_CUDA(cudaStreamSynchronize(stream));
    std::string detail;
    failures += outputs_agree(out_gather, out_copy, m, c.n, &detail) ? 0 : 1;

    for (int i = 0; i < warmup; ++i) {
      run_gather();
      run_copy();
    }
    std::vector<float> t_gather, t_copy;
    for (int i = 0; i < reps; ++i) {
      CHECK_CUDA(cudaEventRecord(ev[0], stream));
      run_gather();
      CHECK_CUDA(cudaEventRecord(ev[1], stream));
      run_copy();
      CHECK_CUDA(cudaEventRecord(ev[2], stream));
      CHECK_CUDA(cudaEventSynchronize(ev[2]));
      float a, b;
      CHECK_CUDA(cudaEventElapsedTime(&a, ev[0], ev[1]));
      CHECK_CUDA(cudaEventElapsedTime(&b, ev[1], ev[2]));
      t_gather.push_back(a);
      t_copy.push_back(b);
    }
    const double ms_gather = median(t_gather), ms_copy = median(t_copy);
    const double flop = 2.0 * m * c.k * c.n;
    std::printf("%-28s %6lld %5lld %5lld %4lld %3lld | %9.3f %8.1f | %9.3f %8.1f | %6.3f %s\n", c.name,
                static_cast<long long>(c.tokens), static_cast<long long>(c.k),
                static_cast<long long>(c.n), static_cast<long long>(c.g),
                static_cast<long long>(c.top_k), ms_gather, flop / ms_gather * 1e-9, ms_copy,
                flop / ms_copy * 1e-9, ms_copy / ms_gather, detail.c_str());
    for (void* p : {static_cast<void*>(x), static_cast<void*>(w), static_cast<void*>(x_sorted),
                    static_cast<void*>(out_gather), static_cast<void*>(out_copy),
                    static_cast<void*>(d_src), static_cast<void*>(d_sizes), gather_ws, gemm_ws}) {
      CHECK_CUDA(cudaFree(p));
    }
  }
  for (auto& e : ev) CHECK_CUDA(cudaEventDestroy(e));
  CHECK_CUDA(cudaStreamDestroy(stream));
  std::printf("%s\n", failures ? "FAIL: outputs differ" : "checks ok");
  return failures ? 1 : 0;
}
