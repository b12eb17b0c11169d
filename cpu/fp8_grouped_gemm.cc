// CPU FP8 blockwise grouped product. Work items are (group, 16 rows, 64 columns) tiles;
// every output element is computed by one thread in the contract's order, so the thread
// count never changes a bit. Built with -ffp-contract=off: the product of the two scales
// is rounded on its own before the per-block fma, as the contract states.
#include "cpu/fp8_grouped_gemm.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <vector>

#include "cpu/dtype.h"

namespace moe_xla::cpu {
namespace {

constexpr int64_t kTileRows = 16;
constexpr int64_t kTileCols = 64;

// float32 value of each float8_e4m3fn code.
const std::array<float, 256>& e4m3_table() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int c = 0; c < 256; ++c) t[c] = fp8::fp8_e4m3_to_float(static_cast<uint8_t>(c));
    return t;
  }();
  return table;
}

struct Tile {
  int64_t group, row0, rows, col0, cols;
};

// Decoded lhs rows of one tile, [kTileRows, K] floats, reused across a thread's tiles.
struct Scratch {
  std::vector<float> a;
};

void run_tile(const Fp8GroupedGemmParams& p, const Tile& t, Scratch& s) {
  const auto& e = e4m3_table();
  const int64_t k = p.k, kt = fp8::tiles(k), nt = fp8::tiles(p.n);
  s.a.resize(static_cast<size_t>(t.rows * k));
  for (int64_t i = 0; i < t.rows * k; ++i) s.a[i] = e[p.lhs[t.row0 * k + i]];
  const uint8_t* rhs_g = p.rhs + t.group * p.n * k;
  const float* rhs_scales_g = p.rhs_scales + t.group * kt * nt;
  for (int64_t c = t.col0; c < t.col0 + t.cols; ++c) {
    const uint8_t* b = rhs_g + c * k;
    for (int64_t r = 0; r < t.rows; ++r) {
      const float* a = s.a.data() + r * k;
      const float* lhs_scales = p.lhs_scales + (t.row0 + r) * kt;
      float acc = 0.0f;
      for (int64_t j = 0; j < kt; ++j) {
        float partial = 0.0f;
        for (int64_t i = j * fp8::kTile, end = std::min(i + fp8::kTile, k); i < end; ++i) {
          partial += a[i] * e[b[i]];
        }
        const float scale = lhs_scales[j] * rhs_scales_g[j * nt + c / fp8::kTile];
        acc = std::fma(scale, partial, acc);
      }
      store_from_float(p.out, (t.row0 + r) * p.n + c, p.out_dtype, acc);
    }
  }
}

}  // namespace

void fp8_grouped_gemm(const Fp8GroupedGemmParams& p, int64_t threads, const Schedule& schedule) {
  std::vector<Tile> work;
  int64_t start = 0;
  for (int64_t g = 0; g < p.num_groups; ++g) {
    const int64_t size = clamp_group_size(p.group_sizes[g], start, p.m);
    for (int64_t row0 = start; row0 < start + size; row0 += kTileRows) {
      for (int64_t col0 = 0; col0 < p.n; col0 += kTileCols) {
        work.push_back({g, row0, std::min(kTileRows, start + size - row0), col0, std::min(kTileCols, p.n - col0)});
      }
    }
    start += size;
  }
  parallel_for<Scratch>(static_cast<int64_t>(work.size()), std::max<int64_t>(threads, 1), schedule,
                        [&](Scratch& s, int64_t i) { run_tile(p, work[i], s); });
  if (start < p.m) {  // rows past the last group: +0.0 is all zero bits in bf16 and f32
    const size_t elem = dtype_bytes(p.out_dtype);
    std::memset(static_cast<char*>(p.out) + start * p.n * elem, 0, (p.m - start) * p.n * elem);
  }
}

}  // namespace moe_xla::cpu
