// Host test of the FP8 wgrad's path choice (cuda/fp8_wgrad.h, fp8_wgrad_select_path) on
// the benchmark products' weight gradients and at its edges. Needs no GPU: the choice
// reads only the shapes, dtype and pointers.
#include "cuda/fp8_wgrad.h"

#include <cstdint>
#include <cstdio>

namespace {

using moe_xla::DType;
using moe_xla::Fp8WgradParams;
using moe_xla::cuda::Fp8WgradPath;
using moe_xla::cuda::fp8_wgrad_select_path;

int failures = 0;

// d w [groups, k, n] from m rows, with 16-byte-aligned stand-in pointers (never
// dereferenced).
Fp8WgradParams wgrad(int64_t m, int64_t groups, int64_t k, int64_t n, DType out = DType::kBF16) {
  Fp8WgradParams p{};
  p.lhs_t = reinterpret_cast<const uint8_t*>(uintptr_t{1} << 20);
  p.lhs_scales = reinterpret_cast<const float*>(uintptr_t{2} << 20);
  p.rhs_t = reinterpret_cast<const uint8_t*>(uintptr_t{3} << 20);
  p.rhs_scales = reinterpret_cast<const float*>(uintptr_t{4} << 20);
  p.group_sizes = reinterpret_cast<const int32_t*>(uintptr_t{5} << 20);
  p.out = reinterpret_cast<void*>(uintptr_t{6} << 20);
  p.out_dtype = out;
  p.m = m;
  p.k = k;
  p.n = n;
  p.num_groups = groups;
  return p;
}

void expect_auto(const char* what, const Fp8WgradParams& p, Fp8WgradPath want) {
  const Fp8WgradPath got = fp8_wgrad_select_path(p);
  if (got == want) return;
  ++failures;
  std::printf("FAIL %s: auto picks path %d, expected %d (cuda::Fp8WgradPath)\n", what, static_cast<int>(got),
              static_cast<int>(want));
}

}  // namespace

int main() {
  const Fp8WgradPath wide = Fp8WgradPath::kWgmma128x192;
  const Fp8WgradPath narrow = Fp8WgradPath::kWgmma128x128;
  // The weight gradients of the grouped_matmul cases of cases.json: d w [G, K, N].
  expect_auto("qwen3 gate_up (N 1536: four whole pairs)", wgrad(131072, 128, 2048, 1536), wide);
  expect_auto("qwen3 down (N 2048: 11% of the pairs' 2304 columns past N)", wgrad(131072, 128, 768, 2048), narrow);
  expect_auto("deepseek gate_up (N 4096: 3%)", wgrad(32768, 32, 7168, 4096), wide);
  expect_auto("deepseek down (N 7168: 1.8%)", wgrad(32768, 32, 2048, 7168), wide);
  expect_auto("mixtral gate_up (N 28672: 0.4%)", wgrad(32768, 8, 4096, 28672), wide);
  expect_auto("float32 output", wgrad(32768, 8, 4096, 28672, DType::kF32), wide);
  // The edge, nine pairs (3456 columns): N 3184 leaves 272 of them past N (7.9%) and keeps
  // the wide tiles, N 3176 leaves 280 (8.1%) and does not.
  expect_auto("N 3184", wgrad(8192, 8, 512, 3184), wide);
  expect_auto("N 3176", wgrad(8192, 8, 512, 3176), narrow);
  // Our kernel needs N % 8 == 0 and K % 4 == 0: CUTLASS takes N % 8 == 0 for bf16 output
  // (16-byte output rows) and nothing else here, so the rest is SIMT.
  expect_auto("K 202", wgrad(8192, 8, 202, 1536), Fp8WgradPath::kCutlass);
  expect_auto("N 1540", wgrad(8192, 8, 512, 1540), Fp8WgradPath::kSimt);
  Fp8WgradParams misaligned = wgrad(8192, 8, 2048, 1536);
  misaligned.lhs_scales = reinterpret_cast<const float*>((uintptr_t{2} << 20) + 4);
  expect_auto("misaligned scales (TMA loads them)", misaligned, Fp8WgradPath::kCutlass);
  expect_auto("no groups", wgrad(0, 0, 512, 1536), Fp8WgradPath::kSimt);
  if (failures == 0) std::printf("PASSED\n");
  return failures == 0 ? 0 : 1;
}
