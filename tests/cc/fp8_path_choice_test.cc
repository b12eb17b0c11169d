// Host test of the FP8 path choices on the benchmark products and at their edges: the
// grouped GEMM's (cuda/fp8_grouped_gemm.h: which kernel auto picks, and which forced paths
// refuse a product) and the wgrad's (cuda/fp8_wgrad.h, fp8_wgrad_select_path). Needs no
// GPU: the choices read only the shapes, dtype and pointers.
#include "cuda/fp8_grouped_gemm.h"
#include "cuda/fp8_wgrad.h"

#include <cstdint>
#include <cstdio>

namespace {

using moe_xla::DType;
using moe_xla::Fp8GroupedGemmParams;
using moe_xla::Fp8WgradParams;
using moe_xla::cuda::Fp8GemmPath;
using moe_xla::cuda::Fp8WgradPath;
using moe_xla::cuda::fp8_gemm_path_name;
using moe_xla::cuda::fp8_gemm_path_supported;
using moe_xla::cuda::fp8_gemm_select_path;
using moe_xla::cuda::fp8_wgrad_select_path;

int failures = 0;

// The i-th 16-byte-aligned stand-in pointer (1 MiB apart; never dereferenced).
template <class T>
T* stand_in(uintptr_t i) {
  return reinterpret_cast<T*>(i << 20);
}

// The fields the grouped GEMM's and the wgrad's parameters share: stand-in scales, group
// sizes and output, the output dtype and the shape (m rows in `groups` groups, k, n).
template <class Params>
Params with_shape(Params p, int64_t m, int64_t groups, int64_t k, int64_t n, DType out) {
  p.lhs_scales = stand_in<const float>(2);
  p.rhs_scales = stand_in<const float>(4);
  p.group_sizes = stand_in<const int32_t>(5);
  p.out = stand_in<void>(6);
  p.out_dtype = out;
  p.m = m;
  p.k = k;
  p.n = n;
  p.num_groups = groups;
  return p;
}

// A product of m rows in `groups` groups, [m, k] x [groups, n, k].
Fp8GroupedGemmParams product(int64_t m, int64_t groups, int64_t k, int64_t n, DType out = DType::kBF16) {
  Fp8GroupedGemmParams p{};
  p.lhs = stand_in<const uint8_t>(1);
  p.rhs = stand_in<const uint8_t>(3);
  return with_shape(p, m, groups, k, n, out);
}

void expect_auto(const char* what, const Fp8GroupedGemmParams& p, Fp8GemmPath want) {
  const Fp8GemmPath got = fp8_gemm_select_path(p, 132);
  if (got == want) return;
  ++failures;
  std::printf("FAIL %s: auto picks %s, expected %s\n", what, fp8_gemm_path_name(got), fp8_gemm_path_name(want));
}

void expect_supported(const char* what, const Fp8GroupedGemmParams& p, Fp8GemmPath path, bool want) {
  if (fp8_gemm_path_supported(p, path) == want) return;
  ++failures;
  std::printf("FAIL %s: path %s supported %d, expected %d\n", what, fp8_gemm_path_name(path), !want, want);
}

// The wgrad d w [groups, k, n] from m rows.
Fp8WgradParams wgrad(int64_t m, int64_t groups, int64_t k, int64_t n, DType out = DType::kBF16) {
  Fp8WgradParams p{};
  p.lhs_t = stand_in<const uint8_t>(1);
  p.rhs_t = stand_in<const uint8_t>(3);
  return with_shape(p, m, groups, k, n, out);
}

void expect_wgrad_auto(const char* what, const Fp8WgradParams& p, Fp8WgradPath want) {
  const Fp8WgradPath got = fp8_wgrad_select_path(p);
  if (got == want) return;
  ++failures;
  std::printf("FAIL wgrad %s: auto picks path %d, expected %d (cuda::Fp8WgradPath)\n", what, static_cast<int>(got),
              static_cast<int>(want));
}

// The wgrad's choice on the weight gradients of the grouped_matmul cases, d w [G, K, N],
// and its edges.
void check_wgrad_choice() {
  const Fp8WgradPath wide = Fp8WgradPath::kWgmma128x192;
  const Fp8WgradPath narrow = Fp8WgradPath::kWgmma128x128;
  expect_wgrad_auto("qwen3 gate_up (N 1536: four whole pairs)", wgrad(131072, 128, 2048, 1536), wide);
  expect_wgrad_auto("qwen3 down (N 2048: 11% of the pairs' 2304 columns past N)", wgrad(131072, 128, 768, 2048),
                    narrow);
  expect_wgrad_auto("deepseek gate_up (N 4096: 3%)", wgrad(32768, 32, 7168, 4096), wide);
  expect_wgrad_auto("deepseek down (N 7168: 1.8%)", wgrad(32768, 32, 2048, 7168), wide);
  expect_wgrad_auto("mixtral gate_up (N 28672: 0.4%)", wgrad(32768, 8, 4096, 28672), wide);
  expect_wgrad_auto("float32 output", wgrad(32768, 8, 4096, 28672, DType::kF32), wide);
  // The edge, nine pairs (3456 columns): N 3184 leaves 272 of them past N (7.9%) and keeps
  // the wide tiles, N 3176 leaves 280 (8.1%) and does not.
  expect_wgrad_auto("N 3184", wgrad(8192, 8, 512, 3184), wide);
  expect_wgrad_auto("N 3176", wgrad(8192, 8, 512, 3176), narrow);
  // Our kernel needs N % 8 == 0 and K % 4 == 0: CUTLASS takes N % 8 == 0 for bf16 output
  // (16-byte output rows) and nothing else here, so the rest is SIMT.
  expect_wgrad_auto("K 202", wgrad(8192, 8, 202, 1536), Fp8WgradPath::kCutlass);
  expect_wgrad_auto("N 1540", wgrad(8192, 8, 512, 1540), Fp8WgradPath::kSimt);
  Fp8WgradParams misaligned = wgrad(8192, 8, 2048, 1536);
  misaligned.lhs_scales = stand_in<const float>(2) + 1;
  expect_wgrad_auto("misaligned scales (TMA loads them)", misaligned, Fp8WgradPath::kCutlass);
  expect_wgrad_auto("no groups", wgrad(0, 0, 512, 1536), Fp8WgradPath::kSimt);
}

}  // namespace

int main() {
  const Fp8GemmPath wide = Fp8GemmPath::kWgmma128x192;
  const Fp8GemmPath bulk = Fp8GemmPath::kWgmma128x192Bulk;
  const Fp8GemmPath coop = Fp8GemmPath::kCutlassCoop128x128Cluster1x2;
  // The grouped_matmul cases of cases.json (and their dgrads' shapes where they differ).
  expect_auto("qwen3 gate_up", product(131072, 128, 2048, 1536), wide);
  expect_auto("qwen3 down (N 2048: 11% of the pairs' columns past N, K 768)", product(131072, 128, 768, 2048), wide);
  expect_auto("deepseek gate_up (N 4096: 3% past N at K 7168)", product(32768, 32, 7168, 4096), bulk);
  expect_auto("deepseek gate_up, float32 output", product(32768, 32, 7168, 4096, DType::kF32), coop);
  expect_auto("deepseek down (N 7168: 1.75% past N)", product(32768, 32, 2048, 7168), wide);
  expect_auto("deepseek down's dgrad (N 2048 at K 7168: 11%)", product(32768, 32, 7168, 2048), coop);
  expect_auto("mixtral gate_up", product(32768, 8, 4096, 28672), bulk);
  expect_auto("float32 output", product(32768, 8, 4096, 28672, DType::kF32), wide);
  // Narrow N: one pair of 192-column tiles for 256 columns pads 33%, two pairs for 640 pad
  // 17% (and 640 is an odd count of 128-column tiles); one pair is exactly 384.
  expect_auto("N 256", product(8192, 8, 512, 256), coop);
  expect_auto("N 640", product(8192, 8, 512, 640), Fp8GemmPath::kCutlassCoop128x128Cluster2x1);
  expect_auto("N 384", product(8192, 8, 512, 384), wide);
  // 27 tiles of 192 columns: the last pair's second tile lies wholly past N (4.8% of the
  // pairs' columns, where the tiles alone pad 1.2%).
  expect_auto("N 5120 at K 4096", product(32768, 8, 4096, 5120), coop);
  expect_auto("N 5120 at K 4080 (4.8% past N: 12% allowed below K 4096)", product(32768, 8, 4080, 5120), wide);
  // Average groups of at most 128 rows: 64-row tiles.
  expect_auto("small groups", product(1000, 16, 2048, 1536), Fp8GemmPath::kCutlassPingpong64x128Cluster1x1);
  // No TMA path: K not a multiple of 16, a misaligned output.
  expect_auto("K 200", product(8192, 8, 200, 1536), Fp8GemmPath::kSimt);
  Fp8GroupedGemmParams misaligned = product(8192, 8, 2048, 1536);
  misaligned.out = stand_in<char>(6) + 8;
  expect_auto("misaligned output", misaligned, Fp8GemmPath::kSimt);
  expect_supported("misaligned output", misaligned, wide, false);
  // The bulk store has no float32 instance.
  expect_supported("bulk store, float32 output", product(8192, 8, 2048, 1536, DType::kF32), bulk, false);
  expect_supported("bulk store, bf16 output", product(8192, 8, 2048, 1536), bulk, true);
  // Our kernel's int32 column offsets: N at most INT32_MAX less two tiles.
  const int64_t near = INT32_MAX - 7 - 256;  // a multiple of 8, within two 128-column tiles' slack
  expect_supported("N = INT32_MAX - 263, 128 columns", product(1, 1, 16, near), Fp8GemmPath::kWgmma128x128, true);
  expect_supported("N = INT32_MAX - 263, 192 columns", product(1, 1, 16, near), wide, false);
  check_wgrad_choice();
  if (failures == 0) std::printf("fp8_path_choice_test: PASSED\n");
  return failures == 0 ? 0 : 1;
}
