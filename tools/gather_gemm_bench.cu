// Benchmark of moe_xla::cuda::gather_gemm against the path it replaces, on the first expert
// GEMM of a MoE layer: the routed first-GEMM cases of tools/gather_bench.cuh.
//
// For each case it routes T tokens to top_k distinct experts each, uniformly at random
// (balanced multinomial routing, fixed seed), sorts the M = T * top_k assignments by
// expert (stable in token order) into src [M] and group_sizes [G], and on the same random
// bf16 x [T, K] and w on the device times, in both layouts of w (one table row each: the
// case name with "/w_kn" for w [G, K, N], "/w_nk" for w [G, N, K], transpose_w)
//   (a) gather:  gather_gemm(x, src, w, group_sizes) -> out [M, N]
//   (b) copy:    a gather kernel x_sorted[r] = x[src[r]] (16-byte vectors), then
//                grouped_gemm (auto configuration; kGmm, or kGmmTransposed for w [G, N, K])
//                of x_sorted with w -> out [M, N]
// and, in a third row ("/swiglu", w [G, K, N] = gate | up, N = 2F), the activation epilogue
// against the unfused first product and activation (its columns "gather" and "copy"):
//   (a) fused:    gather_gemm with activated swiglu -> a [M, F], h kept in float32
//   (b) unfused:  gather_gemm -> h [M, N] bf16, then a swiglu kernel a = silu(gate) * up
//                 (float32 math, bf16x2 vectors) -> a [M, F]
// It checks once that the two outputs agree (max |a - b| / max |b| < 1e-2 on ~4096 rows,
// no NaN), then runs `--warmup` untimed rounds and `--reps` timed rounds, each round
// timing (a) then (b) with one pair of CUDA events around each, and reports the medians in
// ms, TFLOP/s (2 * M * K * N, the GEMM's) and the ratio time(b) / time(a) (> 1: the
// gather GEMM, or the fused epilogue, is faster).
//
// Usage: gather_gemm_bench [--reps N] [--warmup N] [--case SUBSTR]...
// (--case matches the row names, so --case /w_nk times the transposed layout alone and
// --case swiglu the activation epilogue alone.)
// Exit status 1 if a check failed.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "common/expert_activation.h"
#include "common/gather_gemm.h"
#include "common/grouped_gemm.h"
#include "common/status.h"
#include "cuda/gather_gemm.h"
#include "cuda/grouped_gemm.h"
#include "tools/cuda_check.h"
#include "tools/gather_bench.cuh"

namespace {

// A case's routed inputs on the device: its routing, and x [T, K] and w (G * K * N values,
// either layout) uniform in [-1, 1).
struct Routed {
  gather_bench::DeviceRouting routing;
  int64_t m;
  const int32_t *src, *sizes;
  __nv_bfloat16 *x, *w;

  Routed(const gather_bench::GatherCase& c, cudaStream_t stream)
      : routing(c), m(routing.m), src(routing.src), sizes(routing.sizes) {
    CHECK_CUDA(cudaMalloc(&x, c.tokens * c.k * 2));
    CHECK_CUDA(cudaMalloc(&w, c.g * c.k * c.n * 2));
    gather_bench::fill_uniform(x, c.tokens * c.k, 1, stream);
    gather_bench::fill_uniform(w, c.g * c.k * c.n, 2, stream);
  }
  ~Routed() {
    CHECK_CUDA(cudaFree(x));
    CHECK_CUDA(cudaFree(w));
  }
  Routed(const Routed&) = delete;
  Routed& operator=(const Routed&) = delete;
};

// Times and checks one routed case with w in its layout (w [G, N, K] if transpose_w) and
// prints its row; returns 1 if the two paths' outputs differ, else 0.
int run_case(const gather_bench::GatherCase& c, bool transpose_w, const gather_bench::Options& options,
             int sm_count, cudaStream_t stream) {
  using gather_bench::check;
  const Routed in(c, stream);
  const int64_t m = in.m;
  __nv_bfloat16 *x_sorted, *out_gather, *out_copy;
  CHECK_CUDA(cudaMalloc(&x_sorted, m * c.k * 2));
  CHECK_CUDA(cudaMalloc(&out_gather, m * c.n * 2));
  CHECK_CUDA(cudaMalloc(&out_copy, m * c.n * 2));
  auto gp = gather_bench::gather_params<moe_xla::GatherGemmParams>(
      in.x, in.src, in.sizes, out_gather, c.tokens, m, c.k, c.n, c.g);
  gp.w = in.w;
  gp.transpose_w = transpose_w;
  const moe_xla::GroupedLayout layout =
      transpose_w ? moe_xla::GroupedLayout::kGmmTransposed : moe_xla::GroupedLayout::kGmm;
  const moe_xla::GroupedGemmParams mp =
      gather_bench::grouped_params(layout, x_sorted, in.w, in.sizes, out_copy, m, c.k, c.n, c.g);
  const size_t gather_ws_bytes = moe_xla::cuda::gather_gemm_workspace_bytes(gp);
  const size_t gemm_ws_bytes = moe_xla::cuda::grouped_gemm_workspace_bytes(mp, sm_count);
  void *gather_ws, *gemm_ws;
  CHECK_CUDA(cudaMalloc(&gather_ws, gather_ws_bytes));
  CHECK_CUDA(cudaMalloc(&gemm_ws, gemm_ws_bytes));

  auto run_gather = [&] { check(moe_xla::cuda::gather_gemm(gp, gather_ws, gather_ws_bytes, stream), "gather_gemm"); };
  auto run_copy = [&] {
    gather_bench::gather_rows(in.x, in.src, x_sorted, c.tokens, m, c.k, sm_count, stream);
    check(moe_xla::cuda::grouped_gemm(mp, gemm_ws, gemm_ws_bytes, sm_count, stream), "grouped_gemm");
  };

  run_gather();
  run_copy();
  CHECK_CUDA(cudaStreamSynchronize(stream));
  std::string detail;
  const int failures = gather_bench::outputs_agree(out_gather, out_copy, m, c.n, &detail) ? 0 : 1;

  double ms_gather = 0, ms_copy = 0;
  gather_bench::time_pair(options, stream, run_gather, run_copy, &ms_gather, &ms_copy);
  gather_bench::print_row(c, ms_gather, ms_copy, detail);
  for (void* p : {static_cast<void*>(x_sorted), static_cast<void*>(out_gather), static_cast<void*>(out_copy),
                  gather_ws, gemm_ws}) {
    CHECK_CUDA(cudaFree(p));
  }
  return failures;
}

// a[r, c] = silu(h[r, c]) * h[r, f + c] for h [m, 2f] bf16 -> a [m, f] bf16, in float32, two
// columns per thread (f % 2 == 0): the activation kernel of the unfused path.
__global__ void swiglu_kernel(const __nv_bfloat162* __restrict__ h, __nv_bfloat162* __restrict__ a, int64_t m,
                              int64_t f) {
  const int64_t pairs = f / 2;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < m * pairs; i += stride) {
    const int64_t r = i / pairs, c = i % pairs;
    const float2 gate = __bfloat1622float2(h[r * 2 * pairs + c]);
    const float2 up = __bfloat1622float2(h[r * 2 * pairs + pairs + c]);
    a[i] = __floats2bfloat162_rn(moe_xla::silu(gate.x) * up.x, moe_xla::silu(gate.y) * up.y);
  }
}

// Times and checks the fused swiglu epilogue of one routed case (w [G, K, 2F]) against
// gather_gemm + swiglu_kernel and prints its row; returns 1 if the outputs differ, else 0.
int run_swiglu_case(const gather_bench::GatherCase& c, const gather_bench::Options& options, int sm_count,
                    cudaStream_t stream) {
  using gather_bench::check;
  const Routed in(c, stream);
  const int64_t m = in.m, f = c.n / 2;
  __nv_bfloat16 *h, *out_fused, *out_unfused;
  CHECK_CUDA(cudaMalloc(&h, m * c.n * 2));
  CHECK_CUDA(cudaMalloc(&out_fused, m * f * 2));
  CHECK_CUDA(cudaMalloc(&out_unfused, m * f * 2));
  auto fused = gather_bench::gather_params<moe_xla::GatherGemmParams>(in.x, in.src, in.sizes, out_fused, c.tokens,
                                                                      m, c.k, c.n, c.g);
  fused.w = in.w;
  fused.activated = true;
  fused.activation = moe_xla::Activation::kSwiglu;
  auto product = fused;
  product.activated = false;
  product.out = h;
  const size_t ws_bytes = moe_xla::cuda::gather_gemm_workspace_bytes(fused);
  void* ws;
  CHECK_CUDA(cudaMalloc(&ws, ws_bytes));
  const int64_t blocks = std::max<int64_t>(std::min<int64_t>((m * f / 2 + 255) / 256, 8 * int64_t{sm_count}), 1);

  auto run_fused = [&] { check(moe_xla::cuda::gather_gemm(fused, ws, ws_bytes, stream), "gather_gemm swiglu"); };
  auto run_unfused = [&] {
    check(moe_xla::cuda::gather_gemm(product, ws, ws_bytes, stream), "gather_gemm");
    swiglu_kernel<<<static_cast<unsigned>(blocks), 256, 0, stream>>>(
        reinterpret_cast<const __nv_bfloat162*>(h), reinterpret_cast<__nv_bfloat162*>(out_unfused), m, f);
    CHECK_CUDA(cudaGetLastError());
  };

  run_fused();
  run_unfused();
  CHECK_CUDA(cudaStreamSynchronize(stream));
  std::string detail;
  const int failures = gather_bench::outputs_agree(out_fused, out_unfused, m, f, &detail) ? 0 : 1;

  double ms_fused = 0, ms_unfused = 0;
  gather_bench::time_pair(options, stream, run_fused, run_unfused, &ms_fused, &ms_unfused);
  gather_bench::print_row(c, ms_fused, ms_unfused, detail);
  for (void* p : {static_cast<void*>(h), static_cast<void*>(out_fused), static_cast<void*>(out_unfused), ws}) {
    CHECK_CUDA(cudaFree(p));
  }
  return failures;
}

}  // namespace

int main(int argc, char** argv) {
  const gather_bench::Options options = gather_bench::parse_options(argc, argv);
  exit_if_no_cuda_device("gather_gemm_bench");
  const int sm_count = gather_bench::print_device(options);
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  int failures = 0;
  for (const gather_bench::GatherCase& routed : gather_bench::kCases) {
    for (bool transpose_w : {false, true}) {
      const std::string name = std::string(routed.name) + (transpose_w ? "/w_nk" : "/w_kn");
      gather_bench::GatherCase c = routed;
      c.name = name.c_str();
      if (options.selected(c)) failures += run_case(c, transpose_w, options, sm_count, stream);
    }
    const std::string name = std::string(routed.name) + "/swiglu";
    gather_bench::GatherCase c = routed;
    c.name = name.c_str();
    if (options.selected(c)) failures += run_swiglu_case(c, options, sm_count, stream);
  }
  CHECK_CUDA(cudaStreamDestroy(stream));
  std::printf("%s\n", failures ? "FAIL: outputs differ" : "checks ok");
  return failures ? 1 : 0;
}
