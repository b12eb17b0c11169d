// Benchmark of moe_xla::cuda::gather_tgmm against the path it replaces, on the weight
// gradient of the first expert GEMM of a MoE layer: the routed first-GEMM cases of
// tools/gather_bench.cuh (x [T, K], N = the first GEMM's output width).
//
// For each case it routes T tokens to top_k distinct experts each, uniformly at random
// (balanced multinomial routing, fixed seed), sorts the M = T * top_k assignments by
// expert (stable in token order) into src [M] and group_sizes [G], and on the same random
// bf16 x [T, K] and dy [M, N] on the device times
//   (a) gather:  gather_tgmm(x, src, dy, group_sizes) -> d w [G, K, N] (bf16)
//   (b) copy:    a gather kernel x_sorted[r] = x[src[r]] (16-byte vectors), then
//                grouped_gemm (kTgmm, auto configuration) of x_sorted and dy -> d w [G, K, N]
// It checks once that the two outputs agree (max |a - b| / max |b| < 1e-2 on ~4096 rows of
// the [G * K, N] blocks, no NaN), then runs `--warmup` untimed rounds and `--reps` timed
// rounds, each round timing (a) then (b) with one pair of CUDA events around each, and
// reports the medians in ms, TFLOP/s (2 * M * K * N) and the ratio time(b) / time(a)
// (> 1: the gather weight gradient is faster).
//
// Usage: gather_tgmm_bench [--reps N] [--warmup N] [--case SUBSTR]...
// Exit status 1 if a check failed.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "common/gather_tgmm.h"
#include "common/grouped_gemm.h"
#include "common/status.h"
#include "cuda/gather_tgmm.h"
#include "cuda/grouped_gemm.h"
#include "tools/cuda_check.h"
#include "tools/gather_bench.cuh"

int main(int argc, char** argv) {
  using gather_bench::check;
  using moe_xla::DType;
  const gather_bench::Options options = gather_bench::parse_options(argc, argv);
  exit_if_no_cuda_device("gather_tgmm_bench");
  const int sm_count = gather_bench::print_device(options);
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  int failures = 0;

  for (const gather_bench::GatherCase& c : gather_bench::kCases) {
    if (!options.selected(c)) continue;
    const gather_bench::DeviceRouting routing(c);
    const int64_t m = routing.m;
    const int32_t* d_src = routing.src;
    const int32_t* d_sizes = routing.sizes;
    __nv_bfloat16 *x, *dy, *x_sorted, *out_gather, *out_copy;
    CHECK_CUDA(cudaMalloc(&x, c.tokens * c.k * 2));
    CHECK_CUDA(cudaMalloc(&dy, m * c.n * 2));
    CHECK_CUDA(cudaMalloc(&x_sorted, m * c.k * 2));
    CHECK_CUDA(cudaMalloc(&out_gather, c.g * c.k * c.n * 2));
    CHECK_CUDA(cudaMalloc(&out_copy, c.g * c.k * c.n * 2));
    gather_bench::fill_uniform(x, c.tokens * c.k, 1, stream);
    gather_bench::fill_uniform(dy, m * c.n, 3, stream);

    auto gp = gather_bench::gather_params<moe_xla::GatherTgmmParams>(
        x, d_src, d_sizes, out_gather, c.tokens, m, c.k, c.n, c.g);
    gp.dy = dy;
    const moe_xla::GroupedGemmParams tp = gather_bench::grouped_params(
        moe_xla::GroupedLayout::kTgmm, x_sorted, dy, d_sizes, out_copy, m, c.k, c.n, c.g);
    const size_t gather_ws_bytes = moe_xla::cuda::gather_tgmm_workspace_bytes(gp);
    const size_t tgmm_ws_bytes = moe_xla::cuda::grouped_gemm_workspace_bytes(tp, sm_count);
    void *gather_ws, *tgmm_ws;
    CHECK_CUDA(cudaMalloc(&gather_ws, gather_ws_bytes));
    CHECK_CUDA(cudaMalloc(&tgmm_ws, tgmm_ws_bytes));

    auto run_gather = [&] { check(moe_xla::cuda::gather_tgmm(gp, gather_ws, gather_ws_bytes, stream), "gather_tgmm"); };
    auto run_copy = [&] {
      gather_bench::gather_rows(x, d_src, x_sorted, c.tokens, m, c.k, sm_count, stream);
      check(moe_xla::cuda::grouped_gemm(tp, tgmm_ws, tgmm_ws_bytes, sm_count, stream), "grouped_gemm");
    };

    run_gather();
    run_copy();
    CHECK_CUDA(cudaStreamSynchronize(stream));
    std::string detail;
    failures += gather_bench::outputs_agree(out_gather, out_copy, c.g * c.k, c.n, &detail) ? 0 : 1;

    double ms_gather = 0, ms_copy = 0;
    gather_bench::time_pair(options, stream, run_gather, run_copy, &ms_gather, &ms_copy);
    gather_bench::print_row(c, ms_gather, ms_copy, detail);
    for (void* p : {static_cast<void*>(x), static_cast<void*>(dy), static_cast<void*>(x_sorted),
                    static_cast<void*>(out_gather), static_cast<void*>(out_copy), gather_ws, tgmm_ws}) {
      CHECK_CUDA(cudaFree(p));
    }
  }
  CHECK_CUDA(cudaStreamDestroy(stream));
  std::printf("%s\n", failures ? "FAIL: outputs differ" : "checks ok");
  return failures ? 1 : 0;
}
