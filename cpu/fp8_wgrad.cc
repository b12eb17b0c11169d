// CPU FP8 wgrad. Work items are (group, 16 rows of K, 64 columns of N) blocks of the output.
// Per 128-row tile of the group, an item decodes its lhs_t rows into a [16, 128] float block
// and its rhs_t rows, transposed, into a [128, 64] block, so the innermost loop runs across
// the 64 columns of N (one independent sum per output element, vectorisable) while each
// element's tile sum still adds its 128 products in column order. Built with
// -ffp-contract=off: fl(P_t * lhs_scale) is rounded on its own before the tile's fma, as
// the contract states (the products e(a) * e(b) are exact either way).
#include "cpu/fp8_wgrad.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "cpu/dtype.h"
#include "cpu/fp8_decode.h"
#include "cpu/fp8_group_tiles.h"

namespace moe_xla::cpu {
namespace {

constexpr int64_t kBlockK = 16;
constexpr int64_t kBlockN = 64;

struct Block {
  int64_t group, first_tile, tiles, k0, ks, n0, ns;
};

// A thread's scratch, reused across its blocks: a[i * 128 + c] = e(lhs_t[k0 + i, 128 t + c])
// and b[c * kBlockN + j] = e(rhs_t[n0 + j, 128 t + c]) of the tile t being summed.
struct Scratch {
  std::vector<float> a, b;
};

void run_block(const Fp8WgradParams& p, const Block& w, Scratch& s) {
  const auto& e = e4m3_table();
  const int64_t width = fp8::kTile * group_col_tiles(p.m, p.num_groups);
  s.a.resize(static_cast<size_t>(kBlockK * fp8::kTile));
  s.b.assign(static_cast<size_t>(fp8::kTile * kBlockN), 0.0f);  // columns past ns stay 0
  float acc[kBlockK][kBlockN] = {};
  for (int64_t t = w.first_tile; t < w.first_tile + w.tiles; ++t) {
    const int64_t col0 = t * fp8::kTile;
    for (int64_t i = 0; i < w.ks; ++i) {
      const uint8_t* row = p.lhs_t + (w.k0 + i) * width + col0;
      for (int64_t c = 0; c < fp8::kTile; ++c) s.a[i * fp8::kTile + c] = e[row[c]];
    }
    for (int64_t j = 0; j < w.ns; ++j) {
      const uint8_t* row = p.rhs_t + (w.n0 + j) * width + col0;
      for (int64_t c = 0; c < fp8::kTile; ++c) s.b[c * kBlockN + j] = e[row[c]];
    }
    const float* lhs_scales = p.lhs_scales + t * p.k + w.k0;
    const float* rhs_scales = p.rhs_scales + t * p.n + w.n0;
    for (int64_t i = 0; i < w.ks; ++i) {
      float partial[kBlockN] = {};
      for (int64_t c = 0; c < fp8::kTile; ++c) {
        const float ai = s.a[i * fp8::kTile + c];
        const float* bc = s.b.data() + c * kBlockN;
        for (int64_t j = 0; j < kBlockN; ++j) partial[j] += ai * bc[j];
      }
      for (int64_t j = 0; j < w.ns; ++j) acc[i][j] = std::fma(partial[j] * lhs_scales[i], rhs_scales[j], acc[i][j]);
    }
  }
  for (int64_t i = 0; i < w.ks; ++i) {
    for (int64_t j = 0; j < w.ns; ++j) {
      store_from_float(p.out, (w.group * p.k + w.k0 + i) * p.n + w.n0 + j, p.out_dtype, acc[i][j]);
    }
  }
}

}  // namespace

void fp8_wgrad(const Fp8WgradParams& p, int64_t threads, const Schedule& schedule) {
  const std::vector<GroupColSegment> segments = group_col_segments(p.group_sizes, p.num_groups, p.m);
  const size_t group_bytes = static_cast<size_t>(p.k * p.n) * dtype_bytes(p.out_dtype);
  std::vector<Block> work;
  for (int64_t g = 0; g < p.num_groups; ++g) {
    const GroupColSegment& s = segments[g];
    if (s.rows == 0) {  // no rows: +0.0 is all zero bits in bf16 and f32
      std::memset(static_cast<char*>(p.out) + g * group_bytes, 0, group_bytes);
      continue;
    }
    for (int64_t k0 = 0; k0 < p.k; k0 += kBlockK) {
      for (int64_t n0 = 0; n0 < p.n; n0 += kBlockN) {
        work.push_back({g, s.first_tile, fp8::tiles(s.rows), k0, std::min(kBlockK, p.k - k0), n0,
                        std::min(kBlockN, p.n - n0)});
      }
    }
  }
  parallel_for<Scratch>(static_cast<int64_t>(work.size()), std::max<int64_t>(threads, 1), schedule,
                        [&](Scratch& s, int64_t i) { run_block(p, work[i], s); });
}

}  // namespace moe_xla::cpu
