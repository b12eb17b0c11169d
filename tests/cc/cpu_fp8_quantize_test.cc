// The FP8 rules of common/fp8_blockwise.h against brute force, and the CPU kernels' tilings
// (rows, blocks and their transposed copy, and the wgrad's group column tiles written transposed);
// the scaled product and the rows of the fused expansion, with factors and without, and the
// group column tiles of gathered rows and of the expert activation.
//
// e4m3: the 126 positive finite float8_e4m3fn values are written down from the format's
// definition (ldexp, double precision); for every float32 in [2^-12, 480] (both signs) and
// a stride through all the others, the expected code is the nearest of them, a tie going
// to the even code, |v| > 448 (inf too) to 448, NaN to the NaN code 0x7f.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

#include "common/fp8_blockwise.h"
#include "cpu/fp8_quantize.h"

using namespace moe_xla;

namespace {

int failures = 0;

void check(bool ok, const char* what, double value) {
  if (!ok && ++failures <= 20) std::printf("FAIL %s (%.9g)\n", what, value);
}

float from_bits(uint32_t b) {
  float f;
  std::memcpy(&f, &b, sizeof f);
  return f;
}

uint16_t float_bf16(float f) {  // round to nearest even; no NaN here
  uint32_t b;
  std::memcpy(&b, &f, sizeof b);
  return static_cast<uint16_t>((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
}

float bf16_float(uint16_t h) { return from_bits(uint32_t{h} << 16); }

// Value of positive code c in 0..126 from the format: bias 7, 3 mantissa bits.
double code_value(int c) {
  const int e = c >> 3, m = c & 7;
  return e == 0 ? std::ldexp(m, -9) : std::ldexp(1.0 + m / 8.0, e - 7);
}

uint8_t nearest_code(float v, const std::vector<double>& values) {
  const uint8_t sign = std::signbit(v) ? 0x80 : 0;
  if (std::isnan(v)) return 0x7f;
  const double a = std::fabs(static_cast<double>(v));
  if (a >= 448.0) return sign | 0x7e;
  const int lo = static_cast<int>(std::upper_bound(values.begin(), values.end(), a) - values.begin()) - 1;
  const double below = a - values[lo], above = values[lo + 1] - a;
  const int c = below < above ? lo : above < below ? lo + 1 : (lo % 2 == 0 ? lo : lo + 1);
  return sign | static_cast<uint8_t>(c);
}

void test_codes(const std::vector<double>& values) {
  for (int c = 0; c < 256; ++c) {
    const float f = fp8::fp8_e4m3_to_float(static_cast<uint8_t>(c));
    if ((c & 0x7f) == 0x7f) {
      check(std::isnan(f), "NaN code decodes to NaN", c);
      continue;
    }
    const double want = (c & 0x80 ? -1 : 1) * values[c & 0x7f];
    check(f == want && std::signbit(f) == ((c & 0x80) != 0), "code decodes to its value", c);
    check(fp8::fp8_e4m3_from_float(f) == c, "code value encodes to the code", c);
  }
}

void test_rounding(const std::vector<double>& values) {
  // Every float32 from 2^-12 (below half the smallest subnormal 2^-9) to 480 (past the
  // saturation point), both signs: every tie and both neighbours of every tie.
  const uint32_t lo = 115u << 23, hi = 0x43f00000u;  // 2^-12, 480
  for (uint32_t b = lo; b <= hi; ++b) {
    for (const uint32_t sign : {0u, 0x80000000u}) {
      const float v = from_bits(b | sign);
      if (fp8::fp8_e4m3_from_float(v) != nearest_code(v, values)) check(false, "e4m3 rounding", v);
    }
  }
  for (uint64_t b = 0; b < (1ull << 32); b += 9973) {  // everything else, sampled
    const float v = from_bits(static_cast<uint32_t>(b));
    check(fp8::fp8_e4m3_from_float(v) == nearest_code(v, values), "e4m3 rounding (stride)", v);
  }
  check(fp8::fp8_e4m3_from_float(INFINITY) == 0x7e, "inf saturates", INFINITY);
  check(fp8::fp8_e4m3_from_float(-INFINITY) == 0xfe, "-inf saturates", -INFINITY);
  check(fp8::fp8_e4m3_from_float(-NAN) == 0x7f, "-NaN gives the one NaN code", 0);
}

void test_scale() {
  check(fp8::scale_from_amax(0.0f, false) == 1.0f, "amax 0 -> scale 1", 0);
  check(fp8::scale_from_amax(0.0f, true) == 1.0f, "amax 0 -> scale 1 (pow2)", 0);
  check(fp8::scale_from_amax(448.0f, false) == 1.0f, "448 -> 1", 448);
  check(fp8::scale_from_amax(3.0f, false) == 3.0f / 448.0f, "scale = fl(amax / 448)", 3);
  check(fp8::scale_from_amax(449.0f, true) == 2.0f, "pow2 rounds up", 449);
  check(fp8::scale_from_amax(224.0f, true) == 0.5f, "pow2 exact stays", 224);
  check(fp8::scale_from_amax(1e-37f, false) == std::ldexp(1.0f, -126), "scale >= 2^-126", 1e-37);
  for (float amax = 1e-30f; amax < 1e30f; amax *= 1.37f) {
    const float s = fp8::scale_from_amax(amax, true);
    int e = 0;
    check(std::frexp(s, &e) == 0.5f && s >= amax / 448.0f && s / 2 < amax / 448.0f, "pow2 is the next power", amax);
  }
}

void test_element() {
  const float scale = 3.0f / 448.0f;
  check(fp8::quantize_element(3.0f, scale) == 0x7e, "the amax element -> 448", 3);
  check(fp8::quantize_element(1.0f, 1.0f / 3) == fp8::fp8_e4m3_from_float(1.0f / (1.0f / 3)), "one division", 1);
  check(fp8::quantize_element(-1e-40f, std::ldexp(1.0f, -126)) == 0x80, "subnormal -> signed zero", -1e-40);
  check(fp8::quantize_element(INFINITY, scale) == 0x7e, "inf -> 448", INFINITY);
  check(fp8::quantize_element(-NAN, scale) == 0x7f, "-NaN gives the one NaN code", 0);
  check(fp8::quantize_element(NAN, scale) == 0x7f, "NaN", 0);
}

// fast_quotient (the GPU kernels' quotient) codes every finite x as q(x) does, on scales
// of amax values across float32's range (both kinds of scale; the smallest scales it takes,
// kFastScaleMin and just above), for every bf16 value and 4096 random float32s per scale
// up to the scale's amax, subnormals and zeros of both signs included; and its quotient is
// fl(x / scale) itself wherever |x / scale| >= 2^-23.
void test_fast_quotient() {
  uint64_t state = 0x9e3779b97f4a7c15ull;
  auto next = [&state] {
    state ^= state << 13, state ^= state >> 7, state ^= state << 17;
    return state;
  };
  std::vector<float> scales = {fp8::kFastScaleMin, std::nextafter(fp8::kFastScaleMin, 1.0f), 1.0f, 3.0f / 448.0f};
  for (int i = 0; i < 400; ++i) {
    const float amax = from_bits(static_cast<uint32_t>((next() % (254u - 46u) + 46u) << 23 | (next() & 0x7fffffu)));
    scales.push_back(fp8::scale_from_amax(amax, i % 4 == 0));
  }
  int checked = 0;
  for (const float scale : scales) {
    if (scale < fp8::kFastScaleMin) continue;
    const float inverse = fp8::tile_inverse(scale);
    auto one = [&](float x) {
      if (!std::isfinite(x) || std::fabs(x) > 448.0f * scale * 1.001f) return;
      const float v = fp8::fast_quotient(x, scale, inverse);
      check(fp8::fp8_e4m3_from_float(v) == fp8::quantize_element(x, scale), "fast quotient codes as q(x)", x);
      if (std::fabs(x / scale) >= std::ldexp(1.0f, -22)) check(v == x / scale, "fast quotient is fl(x / scale)", x);
      ++checked;
    };
    for (uint32_t h = 0; h < 0x10000u; ++h) one(bf16_float(static_cast<uint16_t>(h)));
    for (int i = 0; i < 4096; ++i) {
      const float unit = from_bits(static_cast<uint32_t>(next() % 0x3f800000u));  // [0, 1), subnormals too
      one((next() & 1 ? -1.0f : 1.0f) * unit * 448.0f * scale);
      one(from_bits(static_cast<uint32_t>(next()) & 0x807fffffu));  // float32 subnormals and zeros
    }
  }
  check(checked > 1000000, "fast quotient: enough finite values checked", checked);
}

// Every x significand against scale significands where the first product is furthest from
// x / s (near 2: q0 up to 1.5 ulps off) and others, with x / s in (1/2, 1) and [1, 2) and
// 2^-22 times those (down to 2^-23, below the 2^-22 the header promises), at the exponent
// of kFastScaleMin and at 1: fast_quotient == fl(x / s) bitwise. (All 2^46 pairs at one
// exponent: tests/cc/fast_quotient_selftest.cu on a GPU.)
void test_fast_quotient_significands() {
  const uint32_t significands[] = {0x7fffff, 0x7ffffe, 0x7ffffd, 0x7fff00, 0x555555,
                                   0x400000, 0x2aaaab, 0x012345, 0x000001, 0x000000};
  int64_t wrong = 0;
  for (const uint32_t sig : significands) {
    for (const int s_exp : {-80, 0}) {
      const float s = std::ldexp(from_bits(0x3f800000u | sig), s_exp);
      const float inverse = fp8::tile_inverse(s);
      for (const int q_exp : {-22, 0}) {
        for (uint32_t m = 0; m < (1u << 23); ++m) {
          const float x = std::ldexp(from_bits(0x3f800000u | m), s_exp + q_exp);
          const float v = fp8::fast_quotient(x, s, inverse);
          if (fp8::float_bits(v) != fp8::float_bits(x / s) && ++wrong <= 5) check(false, "fast quotient of significands", x);
        }
      }
    }
  }
  check(wrong == 0, "fast quotient of significands: mismatches", static_cast<double>(wrong));
}

// A [2, 130, 260] f32 array in 128 x 128 blocks (with q_t, q transposed) and, viewed as
// [260, 260], in 1 x 128 rows: the scales' layout, the tails, and the tile rules (inf, NaN
// ignored; zero tiles scale 1).
void test_kernel() {
  const int64_t g = 2, k = 130, n = 260;
  std::vector<float> x(g * k * n, 0.0f);
  for (int64_t i = 0; i < g * k * n; ++i) x[i] = static_cast<float>((i * 37) % 101) - 50.0f;
  for (int64_t i = 0; i < 2 * n; ++i) x[(1 * k + 128) * n + i] = 0.0f;  // block row (1, 1): 2 zero rows
  x[(1 * k + 129) * n + 3] = 7.0f;                                     // block (1, 1, 0): amax 7
  x[(1 * k + 129) * n + 130] = INFINITY;                               // block (1, 1, 1): inf ignored
  x[(1 * k + 129) * n + 131] = NAN;                                    //   and NaN: amax 0 -> 1
  std::vector<uint8_t> q(x.size()), q_t(x.size(), 0xAA);
  std::vector<float> scales(g * 2 * 3);
  Fp8QuantizeParams p{x.data(), DType::kF32, q.data(), q_t.data(), scales.data(), g, k, n, fp8::kTile, false};
  cpu::fp8_quantize(p);
  for (int64_t b = 0; b < g; ++b) {
    for (int64_t r = 0; r < k; ++r) {
      for (int64_t c = 0; c < n; ++c) {
        check(q_t[(b * n + c) * k + r] == q[(b * k + r) * n + c], "q_t[b, c, r] == q[b, r, c]",
              static_cast<double>((b * k + r) * n + c));
      }
    }
  }
  check(scales[0] == 50.0f / 448.0f, "block (0,0,0) scale", scales[0]);
  check(scales[1 * 6 + 1 * 3 + 0] == 7.0f / 448.0f, "block (1,1,0): a two-row tail", scales[9]);
  check(scales[1 * 6 + 1 * 3 + 1] == 1.0f, "block (1,1,1): inf and NaN only -> 1", scales[10]);
  check(scales[1 * 6 + 1 * 3 + 2] == 1.0f, "block (1,1,2): a zero 2 x 4 tail -> 1", scales[11]);
  check(q[(1 * k + 129) * n + 3] == 0x7e && q[(1 * k + 129) * n + 130] == 0x7e && q[(1 * k + 129) * n + 131] == 0x7f,
        "block elements", 0);

  std::vector<float> row_scales(g * k * 3);
  Fp8QuantizeParams r{x.data(), DType::kF32, q.data(), nullptr, row_scales.data(), 1, g * k, n, 1, true};
  cpu::fp8_quantize(r);
  const int64_t row = 1 * k + 129;
  check(row_scales[row * 3 + 0] == 1.0f / 64, "row tile pow2 scale of amax 7", row_scales[row * 3]);
  check(row_scales[row * 3 + 1] == 1.0f && row_scales[row * 3 + 2] == 1.0f, "row tiles without finite values", 0);
  check(q[row * n + 3] == fp8::fp8_e4m3_from_float(7.0f * 64), "row element", 0);
}

// x [300, 3] in group column tiles with group sizes {0, 130, -4, 3}: segments (start, rows,
// first tile) (0, 130, 0), (130, 3, 2) and the rows past the groups (133, 167, 3), written
// down here rather than derived; T = 3 + 4 = 7 tiles, of which 5 and 6 hold no row.
void test_group_cols() {
  const int64_t rows = 300, cols = 3, tiles = 7, width = 128 * tiles;
  std::vector<float> x(rows * cols);
  for (int64_t i = 0; i < rows * cols; ++i) x[i] = static_cast<float>((i * 37) % 101) - 50.0f;
  x[131 * cols + 1] = NAN;  // ignored by its tile's amax, the NaN code in q_t
  const int32_t group_sizes[] = {0, 130, -4, 3};
  std::vector<uint8_t> q_t(cols * width, 0xAA);
  std::vector<float> scales(tiles * cols, -1.0f);
  Fp8GroupColsParams p{x.data(), DType::kF32, group_sizes, 4, q_t.data(), scales.data(), nullptr, nullptr, rows, cols,
                       false};  // no row tiles
  cpu::fp8_quantize_group_cols(p);
  std::vector<bool> written(cols * width, false), scaled(tiles, false);
  const int64_t segments[][3] = {{0, 130, 0}, {130, 3, 2}, {133, 167, 3}};
  for (const auto& seg : segments) {
    for (int64_t i0 = 0; i0 < seg[1]; i0 += 128) {
      const int64_t t = seg[2] + i0 / 128, n = std::min<int64_t>(128, seg[1] - i0);
      scaled[t] = true;
      for (int64_t c = 0; c < cols; ++c) {
        float amax = 0.0f;
        for (int64_t i = i0; i < i0 + n; ++i) amax = std::max(amax, fp8::tile_magnitude(x[(seg[0] + i) * cols + c]));
        const float scale = fp8::scale_from_amax(amax, false);
        check(scales[t * cols + c] == scale, "group column tile scale", static_cast<double>(t));
        for (int64_t i = i0; i < i0 + n; ++i) {
          const int64_t at = c * width + 128 * t + (i - i0);
          written[at] = true;
          check(q_t[at] == fp8::quantize_element(x[(seg[0] + i) * cols + c], scale), "group column element",
                static_cast<double>(seg[0] + i));
        }
      }
    }
  }
  for (int64_t i = 0; i < cols * width; ++i) {
    if (!written[i]) check(q_t[i] == 0, "column of no row is 0", static_cast<double>(i));
  }
  for (int64_t t = 0; t < tiles; ++t) {
    for (int64_t c = 0; c < cols && !scaled[t]; ++c) check(scales[t * cols + c] == 1.0f, "tile of no row: scale 1", t);
  }
  check(q_t[1 * width + 128 * 2 + 1] == 0x7f, "NaN in group 3's tile", 131);
}

// The scaled product in this process, which multiplies with gradual underflow (XLA's CPU
// threads flush denormals, which would hide a missing flush): subnormal operands count as
// zeros, products of magnitude at most 2^-126 are zeros of their sign, including one whose
// exact value, in 2^-126 [1 - 2^-24, 1 - 2^-25), gradual underflow rounds up to 2^-126.
void test_scaled_element() {
  const float min_normal = std::ldexp(1.0f, -126);
  const auto same = [](float a, float b) { return std::memcmp(&a, &b, sizeof a) == 0; };
  check(same(fp8::scaled_element(1e30f, 1e-40f), 0.0f), "subnormal value counts as 0", 1e-40);
  check(same(fp8::scaled_element(-1e-40f, 1e30f), -0.0f), "subnormal scale counts as -0", -1e-40);
  check(std::isnan(fp8::scaled_element(INFINITY, 1e-40f)), "inf times a subnormal (0) is NaN", 0);
  check(same(fp8::scaled_element(std::ldexp(1.0f, -120), -std::ldexp(1.0f, -6)), -0.0f), "-2^-126 -> -0", 0);
  const float a = from_bits(1059678382u), b = from_bits(12676332u);  // a b just below 2^-126
  check(a * b == min_normal, "this host rounds a b up to 2^-126 (gradual underflow)", a * b);
  check(same(fp8::scaled_element(a, b), 0.0f), "a b flushes", 0);
  const float above = std::nextafter(std::ldexp(1.0f, -120), 1.0f);
  check(fp8::scaled_element(above, std::ldexp(1.0f, -6)) > min_normal, "above 2^-126 kept", 0);
  check(fp8::scaled_element(3.0f, -0.5f) == -1.5f, "a product", 0);
}

// values [3, 130] bf16 expanded by slots {{2, -1}, {0, 2}, {7, 4}} into 5 rows: row 2 is
// named by pairs 0 and 3 and takes pair 3's term (the last), row 0 pair 2's, row 4 pair
// 5's; rows 1 and 3 (named by none; -1 and 7 name no row) are zero rows (q 0, scales 1);
// q and scales those of the unscaled rows (factor 1), not of the rows as stored.
void test_expand() {
  const int64_t t = 3, k = 2, r = 5, h = 130;
  std::vector<uint16_t> values(t * h), out(r * h, 0xAAAA), unscaled(r * h, 0);
  for (int64_t i = 0; i < t * h; ++i) values[i] = float_bf16((static_cast<float>((i * 37) % 101) - 50.0f) / 7.0f);
  const int32_t slots[] = {2, -1, 0, 2, 7, 4};
  const float factor[] = {0.3f, 1.0f, -1e-40f, 2.0f, 1e30f, 5.0f};
  const int64_t owner[] = {2, -1, 3, -1, 5};
  std::vector<uint8_t> q(r * h, 0xAA), q_want(r * h);
  std::vector<float> scales(r * 2, -1.0f), scales_want(r * 2);
  Fp8ExpandQuantizeParams p{values.data(), DType::kBF16, slots, factor, t, k, out.data(), q.data(), scales.data(),
                            r, h, false};
  cpu::fp8_expand_quantize(p);
  for (int64_t i = 0; i < r; ++i) {
    for (int64_t c = 0; c < h; ++c) {
      const uint16_t want = owner[i] < 0 ? uint16_t{0}
                                         : float_bf16(fp8::scaled_element(factor[owner[i]],
                                                                          bf16_float(values[owner[i] / k * h + c])));
      check(out[i * h + c] == want, "expanded element", static_cast<double>(i * h + c));
      if (owner[i] >= 0) {
        unscaled[i * h + c] = float_bf16(fp8::scaled_element(1.0f, bf16_float(values[owner[i] / k * h + c])));
      }
    }
  }
  cpu::fp8_quantize({unscaled.data(), DType::kBF16, q_want.data(), nullptr, scales_want.data(), 1, r, h, 1, false});
  check(q == q_want && scales == scales_want, "q and scales of the unscaled rows", 0);
  cpu::fp8_quantize({out.data(), DType::kBF16, q_want.data(), nullptr, scales_want.data(), 1, r, h, 1, false});
  check(q != q_want && scales != scales_want, "not those of the rows as stored", 0);
  check(scales[2] == 1.0f && scales[6] == 1.0f && q[h] == 0 && q[3 * h] == 0, "a row of no pair: scale 1, q 0", 0);
}

// Without factors (a null pointer: every factor 1) the expansion is bitwise the one with
// factors of 1, for every bf16 bit pattern as a value (subnormals, +-2^-126, infinities and
// NaNs), slots naming rows twice, no row (-1, R and past it) and leaving rows unnamed; its
// rows are the token rows with entries of magnitude at most 2^-126 as zeros of their sign.
void test_expand_unit() {
  const int64_t h = 128, t = 0x10000 / h, k = 2, r = t * k;
  std::vector<uint16_t> values(t * h);
  for (int64_t i = 0; i < t * h; ++i) values[i] = static_cast<uint16_t>(i);
  std::vector<int32_t> slots(t * k);
  for (int64_t p = 0; p < t * k; ++p) slots[p] = static_cast<int32_t>((p * 5) % (r + 3)) - 1;
  slots[7] = slots[3];  // a row named twice: the later pair owns it
  const std::vector<float> ones(t * k, 1.0f);
  std::vector<uint16_t> out_unit(r * h, 0xAAAA), out_ones(r * h, 0x5555);
  std::vector<uint8_t> q_unit(r * h, 0xAA), q_ones(r * h, 0x55);
  std::vector<float> scales_unit(r, -1.0f), scales_ones(r, -2.0f);
  cpu::fp8_expand_quantize({values.data(), DType::kBF16, slots.data(), nullptr, t, k, out_unit.data(), q_unit.data(),
                            scales_unit.data(), r, h, false});
  cpu::fp8_expand_quantize({values.data(), DType::kBF16, slots.data(), ones.data(), t, k, out_ones.data(),
                            q_ones.data(), scales_ones.data(), r, h, false});
  check(out_unit == out_ones, "null factor: the rows of factors of 1", 0);
  check(q_unit == q_ones && scales_unit == scales_ones, "null factor: q and scales of factors of 1", 0);
  std::vector<int64_t> owner(r, -1);
  for (int64_t p = 0; p < t * k; ++p) {
    if (slots[p] >= 0 && slots[p] < r) owner[slots[p]] = p;
  }
  int64_t unnamed = 0;
  for (int64_t i = 0; i < r; ++i) {
    unnamed += owner[i] < 0;
    for (int64_t c = 0; c < h; ++c) {
      const uint16_t v = owner[i] < 0 ? uint16_t{0} : values[owner[i] / k * h + c];
      const bool nan = (v & 0x7fffu) > 0x7f80u;
      const uint16_t want = (v & 0x7fffu) <= 0x0080u ? static_cast<uint16_t>(v & 0x8000u) : v;
      const uint16_t got = out_unit[i * h + c];
      check(nan ? (got & 0x7fffu) > 0x7f80u : got == want, "null factor: the token row, tiny entries zeros", v);
    }
  }
  check(unnamed > 0 && owner[slots[3]] == 7, "the slots leave rows unnamed and name one twice", 0);
}

// Both tilings of rows gathered from values [3, 130] bf16 by sources {2, -1, 0, 2, 3, 1}
// (-1 and 3 name no token: zero rows; token 2 named twice) in groups {2, 0, 3} (row 5 past
// them): the row tiles those of u, the rows with factor 1, the column tiles those of v, the
// rows scaled, each written out here and quantised by the plain kernel; without factor both
// of u. Token 1 holds +-2^-126, a zero in u and, times 4, +-2^-124 in v.
void test_gather_group_cols() {
  const int64_t t = 3, m = 6, h = 130, g = 3, tiles = 1 + g, width = 128 * tiles;
  std::vector<uint16_t> values(t * h);
  for (int64_t i = 0; i < t * h; ++i) values[i] = float_bf16((static_cast<float>((i * 37) % 101) - 50.0f) / 7.0f);
  values[1 * h + 0] = float_bf16(std::ldexp(1.0f, -126));
  values[1 * h + 1] = float_bf16(-std::ldexp(1.0f, -126));
  const int32_t sources[] = {2, -1, 0, 2, 3, 1}, group_sizes[] = {2, 0, 3};
  const float factor[] = {0.3f, 7.0f, -1e-40f, 2.0f, 1e30f, 4.0f};
  std::vector<uint16_t> u(m * h, 0), v(m * h, 0);
  for (int64_t r = 0; r < m; ++r) {
    if (sources[r] < 0 || sources[r] >= t) continue;
    for (int64_t c = 0; c < h; ++c) {
      const float x = bf16_float(values[sources[r] * h + c]);
      u[r * h + c] = float_bf16(fp8::scaled_element(1.0f, x));
      v[r * h + c] = float_bf16(fp8::scaled_element(factor[r], x));
    }
  }
  const auto quantized = [&](const float* f, const std::vector<uint16_t>& cols_of) {
    std::vector<uint8_t> q(m * h, 0xAA), q_t(h * width, 0xAA);
    std::vector<float> row_scales(m * 2, -1.0f), scales(tiles * h, -1.0f);
    Fp8GroupColsParams p{values.data(), DType::kBF16, group_sizes, g, q_t.data(), scales.data(), q.data(),
                         row_scales.data(), m, h, false};
    p.source = GroupColsRows::kGathered;
    p.sources = sources;
    p.factor = f;
    p.values_rows = t;
    cpu::fp8_quantize_group_cols(p);
    std::vector<uint8_t> q_want(m * h), q_t_want(h * width);
    std::vector<float> row_scales_want(m * 2), scales_want(tiles * h);
    cpu::fp8_quantize({u.data(), DType::kBF16, q_want.data(), nullptr, row_scales_want.data(), 1, m, h, 1, false});
    cpu::fp8_quantize_group_cols({cols_of.data(), DType::kBF16, group_sizes, g, q_t_want.data(), scales_want.data(),
                                  nullptr, nullptr, m, h, false});
    check(q == q_want && row_scales == row_scales_want, "gathered row tiles: those of u", 0);
    check(q_t == q_t_want && scales == scales_want, "gathered column tiles: those of v (u without factor)", 0);
    check(row_scales[1 * 2] == 1.0f && row_scales[4 * 2 + 1] == 1.0f && q[1 * h] == 0 && q[4 * h + 129] == 0,
          "a source of no token: a zero row", 0);
    return scales;
  };
  const std::vector<float> scaled = quantized(factor, v);
  check(scaled[2 * h + 0] == std::ldexp(1.0f, -126), "4 * 2^-126 in v: a tile of scale 2^-126", scaled[2 * h]);
  const std::vector<float> unscaled = quantized(nullptr, u);
  check(unscaled != scaled, "the factors change the column tiles", 0);
}

// Both tilings of the activation of h [6, 2 x 130] (gated) or [6, 130] bf16, every activation,
// in groups {2, 0, 3} (row 5 past them): bitwise fp8_activate_quantize's (q, scales) and the
// plain kernel's column tiles of its a.
void test_activate_group_cols() {
  const int64_t m = 6, f = 130, g = 3, tiles = 1 + g, width = 128 * tiles;
  const int32_t group_sizes[] = {2, 0, 3};
  for (int32_t act = 0; act < kNumActivations; ++act) {
    const Activation activation = static_cast<Activation>(act);
    const int64_t h_cols = is_gated(activation) ? 2 * f : f;
    std::vector<uint16_t> h(m * h_cols), a(m * f);
    for (int64_t i = 0; i < m * h_cols; ++i) {
      h[i] = float_bf16((static_cast<float>((i * 37 + act) % 101) - 50.0f) / 9.0f);
    }
    std::vector<uint8_t> q(m * f, 0xAA), q_t(f * width, 0xAA), q_want(m * f), q_t_want(f * width);
    std::vector<float> row_scales(m * 2, -1.0f), scales(tiles * f, -1.0f);
    std::vector<float> row_scales_want(m * 2), scales_want(tiles * f);
    Fp8GroupColsParams p{h.data(), DType::kBF16, group_sizes, g, q_t.data(), scales.data(), q.data(),
                         row_scales.data(), m, f, false};
    p.source = GroupColsRows::kActivated;
    p.activation = activation;
    cpu::fp8_quantize_group_cols(p);
    cpu::fp8_activate_quantize({h.data(), DType::kBF16, a.data(), q_want.data(), row_scales_want.data(), m, f,
                                activation, false});
    cpu::fp8_quantize_group_cols({a.data(), DType::kBF16, group_sizes, g, q_t_want.data(), scales_want.data(),
                                  nullptr, nullptr, m, f, false});
    check(q == q_want && row_scales == row_scales_want, "activated row tiles: fp8_activate_quantize's", act);
    check(q_t == q_t_want && scales == scales_want, "activated column tiles: those of its a", act);
  }
}

}  // namespace

int main() {
  std::vector<double> values(127);
  for (int c = 0; c < 127; ++c) values[c] = code_value(c);
  test_codes(values);
  test_rounding(values);
  test_scale();
  test_element();
  test_fast_quotient();
  test_fast_quotient_significands();
  test_kernel();
  test_group_cols();
  test_scaled_element();
  test_expand();
  test_expand_unit();
  test_gather_group_cols();
  test_activate_group_cols();
  std::printf("%s: %d failures\n", failures ? "FAIL" : "PASS", failures);
  return failures ? 1 : 0;
}
