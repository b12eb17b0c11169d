// CPU FP8 blockwise grouped product. Work items are (group, 16 rows, 64 columns) tiles.
// A tile's rhs columns are decoded once into a [K, 64] float block, so the innermost loop
// runs across the 64 columns (one independent sum per column, vectorisable) while each
// column's block sum still adds its products in k order: every output element is the
// contract's, whatever the vector width or the thread count. Built with
// -ffp-contract=off: the product of the two scales is rounded on its own before the
// per-block fma, as the contract states (the products e(a) * e(b) are exact either way).
#include "cpu/fp8_grouped_gemm.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "cpu/dtype.h"
#include "cpu/fp8_decode.h"

namespace moe_xla::cpu {
namespace {

constexpr int64_t kTileRows = 16;
constexpr int64_t kTileCols = 64;

struct Tile {
  int64_t group, row0, rows, col0, cols;
};

// A thread's scratch, reused across its tiles: the tile's rhs columns decoded and
// transposed, b[k * kTileCols + c] = e(rhs[g, col0 + c, k]).
struct Scratch {
  std::vector<float> b;
};

void run_tile(const Fp8GroupedGemmParams& p, const Tile& t, Scratch& s) {
  const auto& e = e4m3_table();
  const int64_t k = p.k, kt = fp8::tiles(k), nt = fp8::tiles(p.n);
  s.b.assign(static_cast<size_t>(k * kTileCols), 0.0f);
  const uint8_t* rhs = p.rhs + (t.group * p.n + t.col0) * k;
  for (int64_t c = 0; c < t.cols; ++c) {
    for (int64_t i = 0; i < k; ++i) s.b[i * kTileCols + c] = e[rhs[c * k + i]];
  }
  const float* rhs_scales = p.rhs_scales + t.group * kt * nt;
  for (int64_t r = t.row0; r < t.row0 + t.rows; ++r) {
    const uint8_t* a = p.lhs + r * k;
    float acc[kTileCols] = {};
    for (int64_t j = 0; j < kt; ++j) {
      float partial[kTileCols] = {};
      for (int64_t i = j * fp8::kTile, end = std::min(i + fp8::kTile, k); i < end; ++i) {
        const float ai = e[a[i]];
        const float* bi = s.b.data() + i * kTileCols;
        for (int64_t c = 0; c < kTileCols; ++c) partial[c] += ai * bi[c];
      }
      const float lhs_scale = p.lhs_scales[r * kt + j];
      for (int64_t c = 0; c < t.cols; ++c) {
        const float scale = lhs_scale * rhs_scales[j * nt + (t.col0 + c) / fp8::kTile];
        acc[c] = std::fma(scale, partial[c], acc[c]);
      }
    }
    for (int64_t c = 0; c < t.cols; ++c) store_from_float(p.out, r * p.n + t.col0 + c, p.out_dtype, acc[c]);
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
