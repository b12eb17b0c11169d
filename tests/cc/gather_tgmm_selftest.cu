// Standalone GPU self-check of moe_xla::cuda::gather_tgmm (common/gather_tgmm.h).
//
// For every case (random and adversarial group sizes: empty groups, one row, all rows in
// one group, a giant group of many row steps, negative and INT32-extreme sizes, sums below
// and above M, G up to 512; src with entries -1, T, INT32_MIN and INT32_MAX; K and N that
// are not multiples of the tiles; no tokens (x null), no rows; rows of dy past the groups
// holding NaN and inf; a NaN and an inf inside one group's rows), both output dtypes
// (bf16, f32) and both block layouts (out [G, K, N], and [G, N, K] with transpose_out) it:
//   1. poisons the output with NaN and surrounds it with canaries,
//   2. runs gather_tgmm with exactly gather_tgmm_workspace_bytes of (misaligned) scratch,
//   3. compares with a reference kernel that computes every output element on its own,
//      one float64 sum over the group's rows in row order, from the groups' rows (the
//      clamp rule of common/grouped_gemm.h, on the host) and src (a zero row of x where src
//      is outside [0, T)): where the reference is finite, |out - ref| <= tol * max|ref| of
//      the case's finite values (tol 1e-2 for bf16 output, 1e-4 for f32) and out finite
//      (the NaN and inf of dy rows outside a group never reach its block); where the
//      reference is not finite (a group with a NaN or inf row of its own), out is not
//      finite either; exact zeros in the blocks of empty groups; canaries intact,
//   4. captures the same call into a CUDA graph, rewrites group_sizes and src in device
//      memory, replays the graph and checks against the reference of the new inputs
//      (the sizes are read on the device at run time; the call is graph capturable).
// It also checks that K or N not a multiple of 8, and f32 inputs, are InvalidArgument
// errors. Prints one line per case and a PASS/FAIL summary; exit status 1 if any check
// failed. On a GPU other than compute capability 9.0, or without a GPU, it exits 0 saying
// it skipped. Usage: gather_tgmm_selftest
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "common/gather_tgmm.h"
#include "common/grouped_gemm.h"
#include "common/status.h"
#include "cuda/gather_tgmm.h"
#include "tests/cc/gather_selftest.cuh"
#include "tools/cuda_check.h"

namespace {

using gather_selftest::device_copy;
using gather_selftest::kGuardBytes;
using gather_selftest::random_bf16;
using gather_selftest::random_sizes;
using moe_xla::DType;
using moe_xla::dtype_bytes;
using moe_xla::dtype_name;
using moe_xla::GatherTgmmParams;

// Rows [start_g, end_g) of every group under the clamp rule.
void group_rows(const std::vector<int32_t>& sizes, int64_t m, std::vector<int64_t>* starts,
                std::vector<int64_t>* ends) {
  starts->clear();
  ends->clear();
  int64_t start = 0;
  for (int32_t size : sizes) {
    const int64_t rows = moe_xla::clamp_group_size(size, start, m);
    starts->push_back(start);
    ends->push_back(start + rows);
    start += rows;
  }
}

// ref[g, i, c] = sum over r in [start_g, end_g) of x_r[i] * dy[r, c] in float64, in row
// order, x_r = x[src[r]] for src[r] in [0, T) and 0 otherwise (0 * inf is NaN, as in the
// contract).
__global__ void reference_kernel(const __nv_bfloat16* __restrict__ x, const int32_t* __restrict__ src,
                                 const __nv_bfloat16* __restrict__ dy, const int64_t* __restrict__ starts,
                                 const int64_t* __restrict__ ends, int64_t tokens, int64_t groups,
                                 int64_t k, int64_t n, double* __restrict__ ref) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= groups * k * n) return;
  const int64_t g = i / (k * n), row = i / n % k, c = i % n;
  double acc = 0;
  for (int64_t r = starts[g]; r < ends[g]; ++r) {
    const int32_t s = src[r];
    const double xv = s >= 0 && s < tokens ? static_cast<double>(__bfloat162float(x[s * k + row])) : 0.0;
    acc += xv * static_cast<double>(__bfloat162float(dy[r * n + c]));
  }
  ref[i] = acc;
}

struct Case {
  std::string name;
  int64_t tokens, m, k, n;
  std::vector<int32_t> sizes;
  std::vector<int32_t> src;
  bool poison_past_groups;            // NaN / inf in the dy rows past the groups
  std::vector<int64_t> poisoned_rows;  // NaN / inf in these dy rows (inside groups)
};

// src of m rows into `tokens` tokens; with `bad` > 0, about one row in `bad` is out of
// range (-1, T, INT32_MIN or INT32_MAX); with no tokens every row is out of range.
std::vector<int32_t> random_src(int64_t m, int64_t tokens, int bad, std::mt19937& rng) {
  std::vector<int32_t> src(static_cast<size_t>(m));
  std::uniform_int_distribution<int32_t> token(0, static_cast<int32_t>(std::max<int64_t>(tokens - 1, 0)));
  const int32_t outside[] = {-1, static_cast<int32_t>(tokens), INT32_MIN, INT32_MAX};
  for (int64_t r = 0; r < m; ++r) {
    src[static_cast<size_t>(r)] = token(rng);
    if (tokens == 0 || (bad > 0 && rng() % bad == 0)) src[static_cast<size_t>(r)] = outside[rng() % 4];
  }
  return src;
}

std::vector<Case> make_cases(std::mt19937& rng) {
  std::vector<Case> cases;
  auto add = [&](const std::string& name, int64_t tokens, int64_t m, int64_t k, int64_t n,
                 std::vector<int32_t> sizes, int bad_src, bool poison_past = false,
                 std::vector<int64_t> poisoned_rows = {}) {
    cases.push_back(Case{name, tokens, m, k, n, std::move(sizes), random_src(m, tokens, bad_src, rng),
                         poison_past, std::move(poisoned_rows)});
  };
  add("uniform 8 groups", 300, 1024, 256, 512, random_sizes(1024, 8, 0, rng), 0);
  add("tails K N", 517, 1037, 200, 264, random_sizes(1037, 5, 0, rng), 0);
  add("bad src", 400, 777, 136, 136, random_sizes(777, 6, 1, rng), 7);
  add("K 8 N 8", 50, 131, 8, 8, random_sizes(131, 3, 0, rng), 5);
  add("K 72 N 520", 250, 600, 72, 520, random_sizes(600, 4, 1, rng), 0);
  add("empty groups", 128, 700, 96, 256, random_sizes(700, 12, 6, rng), 0);
  add("one row per group", 64, 40, 64, 256, std::vector<int32_t>(40, 1), 0);
  add("all rows in one group", 900, 2000, 128, 384, {0, 2000, 0}, 0);
  add("giant group", 3000, 20000, 256, 264, {20000}, 50);
  add("sum below M, NaN past", 100, 500, 64, 128, {100, 0, 150, 50}, 0, true);
  add("sum above M", 100, 500, 64, 128, {300, 200, 400, 7}, 0);
  add("negative and huge sizes", 100, 600, 136, 200, {-5, 100, INT32_MIN, 250, INT32_MAX, 40}, 0);
  add("first group past M", 100, 300, 64, 64, {INT32_MAX, 10, 10}, 0);
  add("no covered rows, NaN", 100, 300, 64, 64, {0, -1, 0}, 0, true);
  add("NaN and inf in a group", 300, 700, 128, 256, {100, 37, 200, 63, 250}, 9, true, {120, 340});
  add("G 512 many empty", 1000, 3000, 256, 256, random_sizes(2900, 512, 300, rng), 20, true);
  add("G 512 tiny", 64, 1500, 64, 136, random_sizes(1400, 512, 0, rng), 0, true);
  add("long K", 200, 700, 1032, 520, random_sizes(700, 3, 0, rng), 0);
  add("G 1", 333, 1111, 320, 1000, {1111}, 0);
  add("M below one step", 10, 37, 64, 256, {20, 17}, 3);
  add("T 1", 1, 300, 64, 256, random_sizes(300, 4, 0, rng), 0);
  add("no tokens", 0, 200, 64, 128, random_sizes(200, 3, 0, rng), 0);
  add("no rows", 50, 0, 64, 128, {5, 3}, 0);
  return cases;
}

struct Device {
  __nv_bfloat16 *x = nullptr, *dy = nullptr;
  int32_t *src = nullptr, *sizes = nullptr;
  int64_t *starts = nullptr, *ends = nullptr;
  double* ref = nullptr;
  char* out_block = nullptr;  // guard | out | guard
  char* workspace = nullptr;
};

// Random dy [m, n] with NaN and +-inf in the case's poisoned rows (alternating by row).
std::vector<__nv_bfloat16> make_dy(const Case& cs, std::mt19937& rng) {
  std::vector<__nv_bfloat16> dy = random_bf16(cs.m * cs.n, 1.0f, rng);
  std::vector<int64_t> rows = cs.poisoned_rows;
  if (cs.poison_past_groups) {
    std::vector<int64_t> starts, ends;
    group_rows(cs.sizes, cs.m, &starts, &ends);
    for (int64_t r = ends.empty() ? 0 : ends.back(); r < cs.m; ++r) rows.push_back(r);
  }
  const float bad[] = {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                       -std::numeric_limits<float>::infinity()};
  for (int64_t r : rows) {
    for (int64_t c = 0; c < cs.n; ++c) dy[static_cast<size_t>(r * cs.n + c)] = __float2bfloat16(bad[r % 3]);
  }
  return dy;
}

struct Runner : gather_selftest::RunnerBase {
  // Compares out (NaN-poisoned before the call, guarded by canaries) with the reference of
  // (src, sizes) already in d.src / d.sizes; "" when it passes.
  std::string compare(const Case& cs, const Device& d, DType out_dtype, bool transposed,
                      const std::vector<int32_t>& sizes) {
    const int64_t groups = static_cast<int64_t>(sizes.size());
    const int64_t count = groups * cs.k * cs.n;
    std::vector<int64_t> starts, ends;
    group_rows(sizes, cs.m, &starts, &ends);
    if (groups > 0) {
      CHECK_CUDA(cudaMemcpy(d.starts, starts.data(), groups * 8, cudaMemcpyHostToDevice));
      CHECK_CUDA(cudaMemcpy(d.ends, ends.data(), groups * 8, cudaMemcpyHostToDevice));
    }
    const int threads = 256;
    if (count > 0) {
      reference_kernel<<<static_cast<unsigned>((count + threads - 1) / threads), threads, 0, stream>>>(
          d.x, d.src, d.dy, d.starts, d.ends, cs.tokens, groups, cs.k, cs.n, d.ref);
      CHECK_CUDA(cudaGetLastError());
    }
    CHECK_CUDA(cudaStreamSynchronize(stream));
    std::vector<double> ref(static_cast<size_t>(count));
    CHECK_CUDA(cudaMemcpy(ref.data(), d.ref, ref.size() * sizeof(double), cudaMemcpyDeviceToHost));
    const size_t out_bytes = static_cast<size_t>(count) * dtype_bytes(out_dtype);
    std::vector<char> block;
    if (!gather_selftest::read_block(d.out_block, out_bytes, &block)) return "canary overwritten";
    const char* out = block.data() + kGuardBytes;
    double max_ref = 0;
    for (double v : ref) {
      if (std::isfinite(v)) max_ref = std::max(max_ref, std::fabs(v));
    }
    const double tol = (out_dtype == DType::kF32 ? 1e-4 : 1e-2) * std::max(max_ref, 1e-30);
    for (int64_t i = 0; i < count; ++i) {
      // ref is [G, K, N]; the transposed output holds element (g, row, c) at (g, c, row).
      const int64_t g = i / (cs.k * cs.n), row = i / cs.n % cs.k, c = i % cs.n;
      const float o =
          gather_selftest::out_element(out, transposed ? (g * cs.n + c) * cs.k + row : i, out_dtype);
      const double r = ref[static_cast<size_t>(i)];
      const bool empty = starts[static_cast<size_t>(g)] == ends[static_cast<size_t>(g)];
      const char* why = !std::isfinite(r) ? (std::isfinite(o) ? "finite where the group's own rows are not" : nullptr)
                        : !std::isfinite(o)        ? "not finite (unwritten, or a leak)"
                        : empty && o != 0.0f       ? "nonzero in an empty group's block"
                        : std::fabs(o - r) > tol   ? "error above tolerance"
                                                   : nullptr;
      if (why != nullptr) {  // formatted only on failure: the G 512 cases hold 33M elements
        char where[192];
        std::snprintf(where, sizeof(where), " at group %lld row %lld col %lld: out %g ref %g",
                      static_cast<long long>(g), static_cast<long long>(row), static_cast<long long>(c), o, r);
        return std::string(why) + where;
      }
    }
    return "";
  }

  void poison(int64_t count, const Device& d, DType out_dtype) {
    const size_t out_bytes = static_cast<size_t>(count) * dtype_bytes(out_dtype);
    gather_selftest::poison(d.out_block, out_bytes);
  }

  void run_case(const Case& cs, DType out_dtype, std::mt19937& rng) {
    for (bool transposed : {false, true}) run_layout(cs, out_dtype, transposed, rng);
  }

  void run_layout(const Case& cs, DType out_dtype, bool transposed, std::mt19937& rng) {
    ++checks;
    const int64_t groups = static_cast<int64_t>(cs.sizes.size());
    const int64_t count = groups * cs.k * cs.n;
    std::printf("%-26s T %5lld M %5lld K %5lld N %5lld G %4lld out %-4s%s", cs.name.c_str(),
                static_cast<long long>(cs.tokens), static_cast<long long>(cs.m),
                static_cast<long long>(cs.k), static_cast<long long>(cs.n), static_cast<long long>(groups),
                dtype_name(out_dtype), transposed ? " transposed" : "");
    Device d;
    d.x = device_copy(random_bf16(cs.tokens * cs.k, 1.0f, rng));
    d.dy = device_copy(make_dy(cs, rng));
    d.src = device_copy(cs.src);
    d.sizes = device_copy(cs.sizes);
    d.starts = device_copy(std::vector<int64_t>(static_cast<size_t>(groups), 0));
    d.ends = device_copy(std::vector<int64_t>(static_cast<size_t>(groups), 0));
    CHECK_CUDA(cudaMalloc(&d.ref, std::max<int64_t>(count, 1) * sizeof(double)));
    const size_t out_bytes = static_cast<size_t>(count) * dtype_bytes(out_dtype);
    CHECK_CUDA(cudaMalloc(&d.out_block, out_bytes + 2 * kGuardBytes));

    GatherTgmmParams p{};
    p.in_dtype = DType::kBF16;
    p.out_dtype = out_dtype;
    p.x = cs.tokens > 0 ? d.x : nullptr;  // no tokens: x may be null
    p.src = d.src;
    p.dy = d.dy;
    p.group_sizes = d.sizes;
    p.out = d.out_block + kGuardBytes;
    p.tokens = cs.tokens;
    p.m = cs.m;
    p.k = cs.k;
    p.n = cs.n;
    p.num_groups = groups;
    p.transpose_out = transposed;
    const size_t ws_bytes = moe_xla::cuda::gather_tgmm_workspace_bytes(p);
    CHECK_CUDA(cudaMalloc(&d.workspace, ws_bytes + 8));
    void* workspace = d.workspace + 8;  // not 256-byte aligned on purpose

    std::string error;
    poison(count, d, out_dtype);
    const moe_xla::Status status = moe_xla::cuda::gather_tgmm(p, workspace, ws_bytes, stream);
    if (!status.ok()) {
      error = "gather_tgmm: " + status.message();
    } else {
      CHECK_CUDA(cudaStreamSynchronize(stream));
      error = compare(cs, d, out_dtype, transposed, cs.sizes);
    }

    // The same call captured into a graph, replayed after the sizes and src changed.
    if (error.empty()) {
      poison(count, d, out_dtype);
      std::vector<int32_t> sizes, src;
      error = gather_selftest::replay_in_graph(
          stream, "gather_tgmm", [&] { return moe_xla::cuda::gather_tgmm(p, workspace, ws_bytes, stream); },
          [&] {  // the sizes reversed, a new src
            sizes = cs.sizes;
            std::reverse(sizes.begin(), sizes.end());
            src = random_src(cs.m, cs.tokens, 9, rng);
            if (!sizes.empty()) CHECK_CUDA(cudaMemcpy(d.sizes, sizes.data(), sizes.size() * 4, cudaMemcpyHostToDevice));
            if (!src.empty()) CHECK_CUDA(cudaMemcpy(d.src, src.data(), src.size() * 4, cudaMemcpyHostToDevice));
          },
          [&] { return compare(cs, d, out_dtype, transposed, sizes); });
    }
    std::printf(" %s\n", error.empty() ? "ok" : "FAIL");
    if (!error.empty()) fail(cs.name + ": " + error);
    for (void* ptr : {static_cast<void*>(d.x), static_cast<void*>(d.dy), static_cast<void*>(d.src),
                      static_cast<void*>(d.sizes), static_cast<void*>(d.starts), static_cast<void*>(d.ends),
                      static_cast<void*>(d.ref), static_cast<void*>(d.out_block),
                      static_cast<void*>(d.workspace)}) {
      CHECK_CUDA(cudaFree(ptr));
    }
  }

  // K or N not a multiple of 8, or inputs other than bf16, must be refused before
  // anything is enqueued.
  void check_rejects() {
    struct Bad {
      int64_t k, n;
      DType in;
    };
    for (const Bad& bad : {Bad{12, 64, DType::kBF16}, Bad{64, 60, DType::kBF16}, Bad{64, 64, DType::kF32}}) {
      ++checks;
      GatherTgmmParams p{};
      p.in_dtype = bad.in;
      p.out_dtype = DType::kBF16;
      p.tokens = 4;
      p.m = 4;
      p.k = bad.k;
      p.n = bad.n;
      p.num_groups = 1;
      const moe_xla::Status status = moe_xla::cuda::gather_tgmm(p, nullptr, 0, stream);
      const bool ok = status.code() == moe_xla::StatusCode::kInvalidArgument;
      std::printf("%-26s K %lld N %lld in %s: %s (%s)\n", "bad params rejected", static_cast<long long>(p.k),
                  static_cast<long long>(p.n), dtype_name(p.in_dtype), ok ? "ok" : "FAIL", status.message().c_str());
      if (!ok) fail("K " + std::to_string(p.k) + " N " + std::to_string(p.n) + " not rejected as InvalidArgument");
    }
  }
};

}  // namespace

int main() {
  return gather_selftest::selftest_main<Runner>("gather_tgmm_selftest", "gather_tgmm", 20240720, make_cases);
}
