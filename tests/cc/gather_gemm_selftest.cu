// Standalone GPU self-check of moe_xla::cuda::gather_gemm (common/gather_gemm.h).
//
// For every case (random and adversarial group sizes: empty groups, one row, all rows in
// one group, negative and huge sizes, sums below and above M, G up to 512; src with
// entries outside [0, T); M, K and N that are not multiples of the tiles), in both layouts
// of w ([G, K, N], and [G, N, K] with transpose_w) and both output dtypes (bf16, f32) it:
//   1. poisons the output with NaN and surrounds it with canaries,
//   2. runs gather_gemm with exactly gather_gemm_workspace_bytes of (misaligned) scratch,
//   3. compares with a reference kernel that computes every output element on its own,
//      one float64 sum in K order, from the row's group (the clamp rule of
//      common/grouped_gemm.h, on the host) and src: error |out - ref| <= tol * max|ref| of
//      the case (tol 1e-2 for bf16 output, 1e-4 for f32), exact zeros where the contract
//      says zero (rows past the groups, rows whose src is out of range), no NaN, canaries
//      intact,
//   4. captures the same call into a CUDA graph, rewrites group_sizes and src in device
//      memory, replays the graph and checks against the reference of the new inputs
//      (the sizes are read on the device at run time; the call is graph capturable).
// The activation cases (GatherGemmParams.activated: swiglu and geglu on w [G, K, 2F] with
// F a multiple of 128, gelu, silu and relu on any N) compare out [M, F] or [M, N] with the
// activation of the same float64 reference, computed on the host in float64
// (gated: g(ref[r, c]) * ref[r, F + c]), with the same zero, NaN, canary and graph checks;
// with f32 output, which the activation epilogue does not have, they check that the call
// is an InvalidArgument error instead.
// It also checks that K or N not a multiple of 8 is an InvalidArgument error in both
// layouts, and that an activation with w [G, N, K] or a gated one with F % 128 != 0 is.
// Prints one line per case and a PASS/FAIL summary; exit status 1 if any check failed.
// On a GPU other than compute capability 9.0, or without a GPU, it exits 0 saying it
// skipped. Usage: gather_gemm_selftest
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "common/expert_activation.h"
#include "common/gather_gemm.h"
#include "common/grouped_gemm.h"
#include "common/status.h"
#include "cuda/gather_gemm.h"
#include "tests/cc/gather_selftest.cuh"
#include "tools/cuda_check.h"

namespace {

using gather_selftest::device_copy;
using gather_selftest::kGuardBytes;
using gather_selftest::random_bf16;
using gather_selftest::random_sizes;
using moe_xla::Activation;
using moe_xla::DType;
using moe_xla::dtype_bytes;
using moe_xla::dtype_name;
using moe_xla::GatherGemmParams;

// Output row r's group under the clamp rule, -1 for rows past the groups.
std::vector<int32_t> row_groups(const std::vector<int32_t>& sizes, int64_t m) {
  std::vector<int32_t> group(static_cast<size_t>(m), -1);
  int64_t start = 0;
  for (size_t g = 0; g < sizes.size(); ++g) {
    const int64_t size = moe_xla::clamp_group_size(sizes[g], start, m);
    for (int64_t r = start; r < start + size; ++r) group[static_cast<size_t>(r)] = static_cast<int32_t>(g);
    start += size;
  }
  return group;
}

// ref[r, c] = sum_k x[src[r], k] * w[group[r], k, c] (w[group[r], c, k] with transpose_w)
// in float64, in K order; 0 where the row has no group or its src is outside [0, T).
__global__ void reference_kernel(const __nv_bfloat16* __restrict__ x, const int32_t* __restrict__ src,
                                 const __nv_bfloat16* __restrict__ w,
                                 const int32_t* __restrict__ group, int64_t tokens, int64_t m,
                                 int64_t k, int64_t n, bool transpose_w, double* __restrict__ ref) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= m * n) return;
  const int64_t r = i / n, c = i % n;
  const int32_t g = group[r], s = src[r];
  double acc = 0;
  if (g >= 0 && s >= 0 && s < tokens) {
    for (int64_t j = 0; j < k; ++j) {
      const int64_t w_index = transpose_w ? (g * n + c) * k + j : (g * k + j) * n + c;
      acc += static_cast<double>(__bfloat162float(x[s * k + j])) *
             static_cast<double>(__bfloat162float(w[w_index]));
    }
  }
  ref[i] = acc;
}

struct Case {
  std::string name;
  int64_t tokens, m, k, n;
  std::vector<int32_t> sizes;
  std::vector<int32_t> src;
  bool transpose_w;  // w [G, N, K]
  bool activated;    // out = activation(product), w [G, K, N]
  Activation activation;

  bool gated() const { return activated && moe_xla::is_gated(activation); }
  // Columns of out: F = N / 2 for a gated activation, else N.
  int64_t out_cols() const { return gated() ? n / 2 : n; }
};

// The activations in float64, from their formulas (common/expert_activation.h states them).
double silu_f64(double v) { return v / (1.0 + std::exp(-v)); }
double gelu_tanh_f64(double v) {
  const double sqrt_2_over_pi = 0.7978845608028654;
  return 0.5 * v * (1.0 + std::tanh(sqrt_2_over_pi * (v + 0.044715 * v * v * v)));
}

// The expected out [M, out_cols] of a case from the float64 product ref [M, N].
std::vector<double> expected_out(const Case& cs, const std::vector<double>& ref) {
  if (!cs.activated) return ref;
  const int64_t cols = cs.out_cols();
  std::vector<double> out(static_cast<size_t>(cs.m * cols));
  for (int64_t r = 0; r < cs.m; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      const double h = ref[static_cast<size_t>(r * cs.n + c)];
      double a = 0;
      switch (cs.activation) {
        case Activation::kSwiglu: a = silu_f64(h) * ref[static_cast<size_t>(r * cs.n + cols + c)]; break;
        case Activation::kGeglu: a = gelu_tanh_f64(h) * ref[static_cast<size_t>(r * cs.n + cols + c)]; break;
        case Activation::kGelu: a = gelu_tanh_f64(h); break;
        case Activation::kSilu: a = silu_f64(h); break;
        case Activation::kRelu: a = std::max(h, 0.0); break;
      }
      out[static_cast<size_t>(r * cols + c)] = a;
    }
  }
  return out;
}

// src of m rows into `tokens` tokens; with `bad` > 0, about one row in `bad` is out of
// range (negative, T, or far past it).
std::vector<int32_t> random_src(int64_t m, int64_t tokens, int bad, std::mt19937& rng) {
  std::vector<int32_t> src(static_cast<size_t>(m));
  std::uniform_int_distribution<int32_t> token(0, static_cast<int32_t>(std::max<int64_t>(tokens - 1, 0)));
  const int32_t outside[] = {-1, static_cast<int32_t>(tokens), INT32_MIN, INT32_MAX};
  for (int64_t r = 0; r < m; ++r) {
    src[static_cast<size_t>(r)] = token(rng);
    if (bad > 0 && rng() % bad == 0) src[static_cast<size_t>(r)] = outside[rng() % 4];
  }
  return src;
}

// Every product case in both layouts of w, the transposed one right after the other; then
// the activation cases (w [G, K, N]).
std::vector<Case> make_cases(std::mt19937& rng) {
  std::vector<Case> cases;
  auto add = [&](const std::string& name, int64_t tokens, int64_t m, int64_t k, int64_t n,
                 const std::vector<int32_t>& sizes, int bad_src) {
    for (bool transpose_w : {false, true}) {
      cases.push_back(Case{name, tokens, m, k, n, sizes, random_src(m, tokens, bad_src, rng), transpose_w, false,
                           Activation::kSwiglu});
    }
  };
  auto add_activated = [&](const std::string& name, Activation act, int64_t tokens, int64_t m, int64_t k,
                           int64_t n, const std::vector<int32_t>& sizes, int bad_src) {
    cases.push_back(Case{name, tokens, m, k, n, sizes, random_src(m, tokens, bad_src, rng), false, true, act});
  };
  add("uniform 8 groups", 300, 1024, 256, 512, random_sizes(1024, 8, 0, rng), 0);
  add("tails M K N", 517, 1037, 200, 264, random_sizes(1037, 5, 0, rng), 0);
  add("bad src", 400, 777, 136, 136, random_sizes(777, 6, 1, rng), 7);
  add("K 8 N 8", 50, 131, 8, 8, random_sizes(131, 3, 0, rng), 5);
  add("K 72 N 520", 250, 600, 72, 520, random_sizes(600, 4, 1, rng), 0);
  add("K 40 N 776 bad src", 300, 900, 40, 776, random_sizes(900, 7, 2, rng), 5);
  add("empty groups", 128, 700, 96, 256, random_sizes(700, 12, 6, rng), 0);
  add("one row per group", 64, 40, 64, 256, std::vector<int32_t>(40, 1), 0);
  add("all rows in one group", 900, 2000, 128, 384, {0, 2000, 0}, 0);
  add("sum below M", 100, 500, 64, 128, {100, 0, 150, 50}, 0);
  add("sum above M", 100, 500, 64, 128, {300, 200, 400, 7}, 0);
  add("negative and huge sizes", 100, 600, 136, 200, {-5, 100, INT32_MIN, 250, INT32_MAX, 40}, 0);
  add("first group past M", 100, 300, 64, 64, {INT32_MAX, 10, 10}, 0);
  add("no covered rows", 100, 300, 64, 64, {0, -1, 0}, 0);
  add("G 512 many empty", 1000, 3000, 256, 256, random_sizes(3000, 512, 300, rng), 20);
  add("G 512 tiny", 64, 1500, 64, 136, random_sizes(1400, 512, 0, rng), 0);
  add("long K", 200, 700, 1032, 520, random_sizes(700, 3, 0, rng), 0);
  add("G 1", 333, 1111, 320, 1000, {1111}, 0);
  add("M below one tile", 10, 37, 64, 256, {20, 17}, 3);
  add("T 1", 1, 300, 64, 256, random_sizes(300, 4, 0, rng), 0);
  // Gated: F = 128 (one column tile), 256, 384 and 768 (several: the up boxes F / 128 further).
  add_activated("swiglu uniform", Activation::kSwiglu, 300, 1024, 256, 512, random_sizes(1024, 8, 0, rng), 0);
  add_activated("geglu uniform", Activation::kGeglu, 300, 1024, 256, 512, random_sizes(1024, 8, 0, rng), 0);
  add_activated("swiglu tails M K", Activation::kSwiglu, 517, 1037, 200, 768, random_sizes(1037, 5, 0, rng), 0);
  add_activated("geglu F 128 bad src", Activation::kGeglu, 400, 777, 136, 256, random_sizes(777, 6, 1, rng), 7);
  add_activated("swiglu empty groups", Activation::kSwiglu, 128, 700, 96, 256, random_sizes(700, 12, 6, rng), 0);
  add_activated("swiglu one giant group", Activation::kSwiglu, 900, 2000, 128, 1536, {0, 2000, 0}, 0);
  add_activated("geglu sum below M", Activation::kGeglu, 100, 500, 64, 256, {100, 0, 150, 50}, 0);
  add_activated("swiglu G 512 many empty", Activation::kSwiglu, 1000, 3000, 256, 256,
                random_sizes(3000, 512, 300, rng), 20);
  add_activated("swiglu long K", Activation::kSwiglu, 200, 700, 1032, 512, random_sizes(700, 3, 0, rng), 0);
  add_activated("swiglu M below one tile", Activation::kSwiglu, 10, 37, 64, 256, {20, 17}, 3);
  // Plain: N tails of the 256-column tiles (N 8, 72, 264, 520).
  add_activated("gelu tails M K N", Activation::kGelu, 517, 1037, 200, 264, random_sizes(1037, 5, 0, rng), 0);
  add_activated("silu empty groups", Activation::kSilu, 128, 700, 96, 520, random_sizes(700, 12, 6, rng), 0);
  add_activated("relu bad src", Activation::kRelu, 400, 777, 136, 72, random_sizes(777, 6, 1, rng), 7);
  add_activated("gelu one giant group", Activation::kGelu, 900, 2000, 128, 384, {0, 2000, 0}, 0);
  add_activated("silu N 8", Activation::kSilu, 50, 131, 8, 8, random_sizes(131, 3, 0, rng), 5);
  add_activated("relu negative and huge sizes", Activation::kRelu, 100, 600, 136, 200,
                {-5, 100, INT32_MIN, 250, INT32_MAX, 40}, 0);
  return cases;
}

struct Device {
  __nv_bfloat16 *x = nullptr, *w = nullptr;
  int32_t *src = nullptr, *sizes = nullptr, *group = nullptr;
  double* ref = nullptr;
  char* out_block = nullptr;  // guard | out | guard
  char* workspace = nullptr;
};

struct Runner : gather_selftest::RunnerBase {
  // Compares out (NaN-poisoned before the call, guarded by canaries) with the reference of
  // (src, sizes) already in d.src / d.sizes; "" when it passes.
  std::string compare(const Case& cs, const Device& d, DType out_dtype,
                      const std::vector<int32_t>& src, const std::vector<int32_t>& sizes) {
    const int64_t mn = cs.m * cs.n;  // of the product
    const int64_t cols = cs.out_cols();
    const std::vector<int32_t> group = row_groups(sizes, cs.m);
    CHECK_CUDA(cudaMemcpy(d.group, group.data(), group.size() * 4, cudaMemcpyHostToDevice));
    const int threads = 256;
    reference_kernel<<<static_cast<unsigned>((mn + threads - 1) / threads), threads, 0, stream>>>(
        d.x, d.src, d.w, d.group, cs.tokens, cs.m, cs.k, cs.n, cs.transpose_w, d.ref);
    CHECK_CUDA(cudaGetLastError());
    CHECK_CUDA(cudaStreamSynchronize(stream));
    std::vector<double> product(static_cast<size_t>(mn));
    CHECK_CUDA(cudaMemcpy(product.data(), d.ref, product.size() * sizeof(double), cudaMemcpyDeviceToHost));
    const std::vector<double> ref = expected_out(cs, product);
    const size_t out_bytes = static_cast<size_t>(cs.m * cols) * dtype_bytes(out_dtype);
    std::vector<char> block;
    if (!gather_selftest::read_block(d.out_block, out_bytes, &block)) return "canary overwritten";
    const char* out = block.data() + kGuardBytes;
    double max_ref = 0;
    for (double v : ref) max_ref = std::max(max_ref, std::fabs(v));
    const double tol = (out_dtype == DType::kF32 ? 1e-4 : 1e-2) * std::max(max_ref, 1e-30);
    for (int64_t i = 0; i < cs.m * cols; ++i) {
      const float o = gather_selftest::out_element(out, i, out_dtype);
      const int64_t r = i / cols;
      const int32_t s = src[static_cast<size_t>(r)];
      const bool zero_row = group[static_cast<size_t>(r)] < 0 || s < 0 || s >= cs.tokens;
      const char* why = std::isnan(o)                                       ? "NaN (unwritten?)"
                        : zero_row && o != 0.0f                              ? "nonzero in a zero row"
                        : std::fabs(o - ref[static_cast<size_t>(i)]) > tol   ? "error above tolerance"
                                                                             : nullptr;
      if (why != nullptr) {  // formatted only on failure
        char where[160];
        std::snprintf(where, sizeof(where), " at row %lld col %lld: out %g ref %g", static_cast<long long>(r),
                      static_cast<long long>(i % cols), o, ref[static_cast<size_t>(i)]);
        return std::string(why) + where;
      }
    }
    return "";
  }

  void poison(const Case& cs, const Device& d, DType out_dtype) {
    const size_t out_bytes = static_cast<size_t>(cs.m * cs.out_cols()) * dtype_bytes(out_dtype);
    gather_selftest::poison(d.out_block, out_bytes);
  }

  void run_case(const Case& cs, DType out_dtype, std::mt19937& rng) {
    ++checks;
    std::printf("%-28s T %5lld M %5lld K %5lld N %5lld G %4zu w %s out %-4s", cs.name.c_str(),
                static_cast<long long>(cs.tokens), static_cast<long long>(cs.m),
                static_cast<long long>(cs.k), static_cast<long long>(cs.n), cs.sizes.size(),
                cs.transpose_w ? "[G,N,K]" : "[G,K,N]", dtype_name(out_dtype));
    if (cs.activated && out_dtype != DType::kBF16) {
      check_rejected(cs, out_dtype);
      return;
    }
    Device d;
    d.x = device_copy(random_bf16(cs.tokens * cs.k, 1.0f, rng));
    d.w = device_copy(random_bf16(static_cast<int64_t>(cs.sizes.size()) * cs.k * cs.n, 1.0f, rng));
    d.src = device_copy(cs.src);
    d.sizes = device_copy(cs.sizes);
    d.group = device_copy(std::vector<int32_t>(static_cast<size_t>(cs.m), -1));
    CHECK_CUDA(cudaMalloc(&d.ref, std::max<int64_t>(cs.m * cs.n, 1) * sizeof(double)));
    const size_t out_bytes = static_cast<size_t>(cs.m * cs.out_cols()) * dtype_bytes(out_dtype);
    CHECK_CUDA(cudaMalloc(&d.out_block, out_bytes + 2 * kGuardBytes));

    GatherGemmParams p = params_of(cs, out_dtype);
    p.x = d.x;
    p.src = d.src;
    p.w = d.w;
    p.group_sizes = d.sizes;
    p.out = d.out_block + kGuardBytes;
    const size_t ws_bytes = moe_xla::cuda::gather_gemm_workspace_bytes(p);
    CHECK_CUDA(cudaMalloc(&d.workspace, ws_bytes + 8));
    void* workspace = d.workspace + 8;  // not 256-byte aligned on purpose

    std::string error;
    poison(cs, d, out_dtype);
    const moe_xla::Status status = moe_xla::cuda::gather_gemm(p, workspace, ws_bytes, stream);
    if (!status.ok()) {
      error = "gather_gemm: " + status.message();
    } else {
      CHECK_CUDA(cudaStreamSynchronize(stream));
      error = compare(cs, d, out_dtype, cs.src, cs.sizes);
    }

    // The same call captured into a graph, replayed after the sizes and src changed.
    if (error.empty()) {
      poison(cs, d, out_dtype);
      std::vector<int32_t> sizes, src;
      error = gather_selftest::replay_in_graph(
          stream, "gather_gemm", [&] { return moe_xla::cuda::gather_gemm(p, workspace, ws_bytes, stream); },
          [&] {  // the sizes reversed, a new src
            sizes = cs.sizes;
            std::reverse(sizes.begin(), sizes.end());
            src = random_src(cs.m, cs.tokens, 9, rng);
            CHECK_CUDA(cudaMemcpy(d.sizes, sizes.data(), sizes.size() * 4, cudaMemcpyHostToDevice));
            CHECK_CUDA(cudaMemcpy(d.src, src.data(), src.size() * 4, cudaMemcpyHostToDevice));
          },
          [&] { return compare(cs, d, out_dtype, src, sizes); });
    }
    std::printf(" %s\n", error.empty() ? "ok" : "FAIL");
    if (!error.empty()) {
      fail(cs.name + (cs.transpose_w ? " (w [G,N,K])" : "") + " out " + dtype_name(out_dtype) + ": " + error);
    }
    for (void* ptr : {static_cast<void*>(d.x), static_cast<void*>(d.w), static_cast<void*>(d.src),
                      static_cast<void*>(d.sizes), static_cast<void*>(d.group),
                      static_cast<void*>(d.ref), static_cast<void*>(d.out_block),
                      static_cast<void*>(d.workspace)}) {
      CHECK_CUDA(cudaFree(ptr));
    }
  }

  // The sizes, dtypes, layout and activation of a case (no pointers).
  static GatherGemmParams params_of(const Case& cs, DType out_dtype) {
    GatherGemmParams p{};
    p.in_dtype = DType::kBF16;
    p.out_dtype = out_dtype;
    p.tokens = cs.tokens;
    p.m = cs.m;
    p.k = cs.k;
    p.n = cs.n;
    p.num_groups = static_cast<int64_t>(cs.sizes.size());
    p.transpose_w = cs.transpose_w;
    p.activated = cs.activated;
    p.activation = cs.activation;
    return p;
  }

  // A case the kernel has no instance for must be an InvalidArgument before anything is
  // enqueued (printed on the line run_case started).
  void check_rejected(const Case& cs, DType out_dtype) {
    const moe_xla::Status status = moe_xla::cuda::gather_gemm(params_of(cs, out_dtype), nullptr, 0, stream);
    const bool ok = status.code() == moe_xla::StatusCode::kInvalidArgument;
    std::printf(" rejected: %s\n", ok ? "ok" : "FAIL");
    if (!ok) fail(cs.name + " out " + dtype_name(out_dtype) + ": not rejected as InvalidArgument");
  }

  // K or N not a multiple of 8 must be refused before anything is enqueued, in both
  // layouts of w; so must an activation with w [G, N, K], and a gated one whose F is not a
  // multiple of 128.
  void check_rejects() {
    for (bool transpose_w : {false, true}) {
      for (const auto& kn : {std::pair<int64_t, int64_t>{12, 64}, std::pair<int64_t, int64_t>{64, 60}}) {
        ++checks;
        GatherGemmParams p{};
        p.in_dtype = p.out_dtype = DType::kBF16;
        p.tokens = 4;
        p.m = 4;
        p.k = kn.first;
        p.n = kn.second;
        p.num_groups = 1;
        p.transpose_w = transpose_w;
        const moe_xla::Status status = moe_xla::cuda::gather_gemm(p, nullptr, 0, stream);
        const bool ok = status.code() == moe_xla::StatusCode::kInvalidArgument;
        const char* layout = transpose_w ? "[G,N,K]" : "[G,K,N]";
        std::printf("%-26s K %lld N %lld w %s: %s\n", "unaligned shape rejected", static_cast<long long>(p.k),
                    static_cast<long long>(p.n), layout, ok ? "ok" : "FAIL");
        if (!ok) {
          fail("K " + std::to_string(p.k) + " N " + std::to_string(p.n) + " w " + layout +
               " not rejected as InvalidArgument");
        }
      }
    }
    struct Rejected {
      const char* name;
      Activation activation;
      int64_t n;
      bool transpose_w;
    };
    const Rejected rejected[] = {{"swiglu F 136", Activation::kSwiglu, 272, false},
                                 {"geglu F 64", Activation::kGeglu, 128, false},
                                 {"swiglu w [G,N,K]", Activation::kSwiglu, 256, true},
                                 {"gelu w [G,N,K]", Activation::kGelu, 256, true}};
    for (const Rejected& r : rejected) {
      ++checks;
      const Case cs{r.name, 4, 4, 64, r.n, {4}, {0, 1, 2, 3}, r.transpose_w, true, r.activation};
      std::printf("%-28s", (std::string(r.name) + " rejected").c_str());
      check_rejected(cs, DType::kBF16);
    }
  }
};

}  // namespace

int main() {
  return gather_selftest::selftest_main<Runner>("gather_gemm_selftest", "gather_gemm", 20240719, make_cases);
}
