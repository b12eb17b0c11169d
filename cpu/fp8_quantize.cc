// CPU FP8 blockwise quantisation: per tile, amax over the tile, then the scale, then each
// element through fp8::quantize_element, the function the CUDA kernel uses too (the blocks
// also copied, code for code, to their transposed place in q_t when asked). The fused
// forms write their rows (the expert activation, its backward, or the token rows expanded and scaled:
// fp8::scaled_element, whose product is flush-mode proof too), rounded to the dtype, and
// quantise them as stored through the row tiles (the expansion quantises its rows with
// factor 1, then writes them scaled); the group column
// form takes its tiles from cpu/fp8_group_tiles.h and writes them transposed (with sources,
// of rows first gathered as gather_rows stores them: with factor 1 for the row tiles, with
// the factors for the column tiles; of the activation written out as the fused activation
// writes it). The
// operations are integer ones and single float32 divisions of normal numbers
// (common/fp8_blockwise.h), so XLA's flush-to-zero mode on its CPU threads changes nothing.
#include "cpu/fp8_quantize.h"

#include <algorithm>
#include <cstdint>
#include <vector>

#include "cpu/dtype.h"
#include "cpu/fp8_group_tiles.h"
#include "cpu/gather_rows.h"

namespace moe_xla::cpu {

void fp8_quantize(const Fp8QuantizeParams& p) {
  const int64_t row_tiles = (p.rows + p.tile_rows - 1) / p.tile_rows;
  const int64_t col_tiles = fp8::tiles(p.cols);
  for (int64_t b = 0; b < p.batch; ++b) {
    for (int64_t rt = 0; rt < row_tiles; ++rt) {
      const int64_t r0 = rt * p.tile_rows, r1 = std::min(r0 + p.tile_rows, p.rows);
      for (int64_t ct = 0; ct < col_tiles; ++ct) {
        const int64_t c0 = ct * fp8::kTile, c1 = std::min(c0 + fp8::kTile, p.cols);
        float amax = 0.0f;
        for (int64_t r = r0; r < r1; ++r) {
          for (int64_t c = c0; c < c1; ++c) {
            amax = std::max(amax, fp8::tile_magnitude(load_as_float(p.x, (b * p.rows + r) * p.cols + c, p.dtype)));
          }
        }
        const float scale = fp8::scale_from_amax(amax, p.pow2_scale);
        p.scales[(b * row_tiles + rt) * col_tiles + ct] = scale;
        for (int64_t r = r0; r < r1; ++r) {
          for (int64_t c = c0; c < c1; ++c) {
            const int64_t i = (b * p.rows + r) * p.cols + c;
            p.q[i] = fp8::quantize_element(load_as_float(p.x, i, p.dtype), scale);
            if (p.q_t != nullptr) p.q_t[(b * p.cols + c) * p.rows + r] = p.q[i];  // q_t[b, c, r] = q[b, r, c]
          }
        }
      }
    }
  }
}

namespace {

// q and scales of rows x [rows, cols] as stored (already rounded to dtype): the row tiles'
// own quantisation, which the fused kernels run on what they wrote.
void quantize_stored_rows(const void* x, DType dtype, int64_t rows, int64_t cols, uint8_t* q, float* scales,
                          bool pow2_scale) {
  Fp8QuantizeParams p{};
  p.x = x;
  p.dtype = dtype;
  p.q = q;
  p.scales = scales;
  p.batch = p.tile_rows = 1;
  p.rows = rows;
  p.cols = cols;
  p.pow2_scale = pow2_scale;
  fp8_quantize(p);
}

// a [rows, cols] = rnd(activate(h)) of h [rows, 2 cols] (gated: gate | up) or [rows, cols],
// both of dtype (common/expert_activation.h).
void write_activation(const void* h, DType dtype, Activation activation, int64_t rows, int64_t cols, void* a) {
  const bool gated = is_gated(activation);
  const int64_t h_cols = gated ? 2 * cols : cols;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      const float gate = load_as_float(h, r * h_cols + c, dtype);
      const float up = gated ? load_as_float(h, r * h_cols + cols + c, dtype) : 0.0f;
      store_from_float(a, r * cols + c, dtype, activate(activation, gate, up));
    }
  }
}

}  // namespace

void fp8_activate_quantize(const Fp8ActivateQuantizeParams& p) {
  write_activation(p.h, p.dtype, p.activation, p.rows, p.cols, p.a);
  quantize_stored_rows(p.a, p.dtype, p.rows, p.cols, p.q, p.scales, p.pow2_scale);
}

void fp8_expand_quantize(const Fp8ExpandQuantizeParams& p) {
  // Each row's owner (the largest pair naming it); the row tiles of the rows as gather_rows
  // stores them from the owners' tokens with factor 1 (the unscaled rows, rounded to their
  // dtype); then the rows from the owners' tokens and factors. Without factors (every
  // factor 1) the unscaled rows are the rows: the second gather would write the same bits.
  std::vector<int64_t> owner(static_cast<size_t>(p.rows), -1);
  for (int64_t pair = 0; pair < p.num_values * p.top_k; ++pair) {
    const int64_t r = p.slots[pair];
    if (r >= 0 && r < p.rows) owner[static_cast<size_t>(r)] = pair;  // pairs ascend: the last is the largest
  }
  std::vector<int32_t> src(owner.size(), -1);
  std::vector<float> scale(owner.size(), 0.0f);
  for (size_t r = 0; r < owner.size(); ++r) {
    if (owner[r] < 0) continue;
    src[r] = static_cast<int32_t>(owner[r] / p.top_k);
    scale[r] = 1.0f;
  }
  gather_rows(GatherRowsParams{p.values, p.dtype, src.data(), scale.data(), p.num_values, p.out, p.rows, p.cols});
  quantize_stored_rows(p.out, p.dtype, p.rows, p.cols, p.q, p.scales, p.pow2_scale);
  if (p.factor == nullptr) return;
  for (size_t r = 0; r < owner.size(); ++r) {
    if (owner[r] >= 0) scale[r] = p.factor[owner[r]];
  }
  gather_rows(GatherRowsParams{p.values, p.dtype, src.data(), scale.data(), p.num_values, p.out, p.rows, p.cols});
}

namespace {

// The rows p.sources names gathered from p.x with each row's factor, as gather_rows stores
// them (rnd(scaled_element(factor[r], x[sources[r]])), zero rows where the source names no row).
std::vector<char> gathered_rows(const Fp8GroupColsParams& p, const float* factor) {
  std::vector<char> rows(static_cast<size_t>(p.rows * p.cols) * dtype_bytes(p.dtype));
  gather_rows(GatherRowsParams{p.x, p.dtype, p.sources, factor, p.values_rows, rows.data(), p.rows, p.cols});
  return rows;
}

// p with its rows stored in `rows` (p.rows x p.cols of p.dtype): the plain kernel's params.
Fp8GroupColsParams stored_params(const Fp8GroupColsParams& p, const std::vector<char>& rows) {
  Fp8GroupColsParams stored = p;
  stored.source = GroupColsRows::kStored;
  stored.sources = nullptr;
  stored.factor = nullptr;
  stored.x = rows.data();
  return stored;
}

// With sources: the rows u (factor 1) and v (p.factor; u without one) written out, then
// u's row tiles and v's column tiles as of rows in memory.
void quantize_gathered_group_cols(const Fp8GroupColsParams& p) {
  const std::vector<float> ones(static_cast<size_t>(p.rows), 1.0f);
  const std::vector<char> u = gathered_rows(p, ones.data());
  Fp8GroupColsParams stored = stored_params(p, u);
  if (p.factor == nullptr) {
    fp8_quantize_group_cols(stored);
    return;
  }
  if (p.q != nullptr) quantize_stored_rows(u.data(), p.dtype, p.rows, p.cols, p.q, p.row_scales, p.pow2_scale);
  const std::vector<char> v = gathered_rows(p, p.factor);
  stored.x = v.data();
  stored.q = nullptr;
  stored.row_scales = nullptr;
  fp8_quantize_group_cols(stored);
}

// kActivated: a = rnd(activate(h)) of h = p.x written out, as fp8_activate_quantize writes
// it, then both tilings of a as of rows in memory.
void quantize_activated_group_cols(const Fp8GroupColsParams& p) {
  std::vector<char> a(static_cast<size_t>(p.rows * p.cols) * dtype_bytes(p.dtype));
  write_activation(p.x, p.dtype, p.activation, p.rows, p.cols, a.data());
  fp8_quantize_group_cols(stored_params(p, a));
}

}  // namespace

void fp8_quantize_group_cols(const Fp8GroupColsParams& p) {
  switch (p.source) {
    case GroupColsRows::kGathered: quantize_gathered_group_cols(p); return;
    case GroupColsRows::kActivated: quantize_activated_group_cols(p); return;
    case GroupColsRows::kStored: break;
  }
  if (p.q != nullptr) quantize_stored_rows(p.x, p.dtype, p.rows, p.cols, p.q, p.row_scales, p.pow2_scale);
  const int64_t tile_count = group_col_tiles(p.rows, p.num_groups), width = fp8::kTile * tile_count;
  std::fill(p.q_t, p.q_t + p.cols * width, uint8_t{0});         // columns of no row
  std::fill(p.scales, p.scales + tile_count * p.cols, 1.0f);    // tiles of no row
  std::vector<float> amax(static_cast<size_t>(p.cols));
  for (const GroupColSegment& s : group_col_segments(p.group_sizes, p.num_groups, p.rows)) {
    for (int64_t r0 = s.start; r0 < s.start + s.rows; r0 += fp8::kTile) {
      // Rows r0 .. r0 + n - 1 form tile t; row r0 + j goes to column 128 t + j of q_t.
      const int64_t t = s.first_tile + (r0 - s.start) / fp8::kTile, n = std::min(fp8::kTile, s.start + s.rows - r0);
      std::fill(amax.begin(), amax.end(), 0.0f);
      for (int64_t j = 0; j < n; ++j) {
        for (int64_t c = 0; c < p.cols; ++c) {
          amax[c] = std::max(amax[c], fp8::tile_magnitude(load_as_float(p.x, (r0 + j) * p.cols + c, p.dtype)));
        }
      }
      float* scales = p.scales + t * p.cols;
      for (int64_t c = 0; c < p.cols; ++c) scales[c] = fp8::scale_from_amax(amax[c], p.pow2_scale);
      for (int64_t j = 0; j < n; ++j) {
        for (int64_t c = 0; c < p.cols; ++c) {
          p.q_t[c * width + t * fp8::kTile + j] =
              fp8::quantize_element(load_as_float(p.x, (r0 + j) * p.cols + c, p.dtype), scales[c]);
        }
      }
    }
  }
}

void fp8_activate_grad_quantize(const Fp8ActivateGradQuantizeParams& p) {
  const bool gated = is_gated(p.activation);
  const int64_t f = gated ? p.cols / 2 : p.cols;
  std::fill(p.d_omega_tiles, p.d_omega_tiles + p.rows * fp8::tiles(f), 0.0f);
  for (int64_t r = 0; r < p.rows; ++r) {
    const float omega = p.omega[r];
    for (int64_t c = 0; c < p.cols; ++c) {
      const bool up_half = gated && c >= f;
      const int64_t e = up_half ? c - f : c;  // the gate (or h) column of this element
      const float gate = load_as_float(p.h, r * p.cols + e, p.dtype);
      const float up = gated ? load_as_float(p.h, r * p.cols + f + e, p.dtype) : 0.0f;
      const float g = load_as_float(p.g, r * f + e, p.dtype);
      store_from_float(p.dh, r * p.cols + c, p.dtype, activate_grad(p.activation, up_half, gate, up, omega * g));
      if (!up_half) {
        p.d_omega_tiles[r * fp8::tiles(f) + e / fp8::kTile] += g * round_to(activate(p.activation, gate, up), p.dtype);
      }
    }
  }
  quantize_stored_rows(p.dh, p.dtype, p.rows, p.cols, p.q, p.scales, p.pow2_scale);
}

}  // namespace moe_xla::cpu
