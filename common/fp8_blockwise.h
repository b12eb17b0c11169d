// Framework-free contract of the FP8 blockwise quantisation (the
// DeepSeek-V3 / DeepGEMM recipe), shared by the CPU kernels (cpu/), the CUDA kernels
// (cuda/) and stated again in plain jnp by moe_xla/reference.py.
//
// Data float8_e4m3fn (E4M3 without infinities: bias 7, 3 mantissa bits, largest finite
// 448, NaN = S.1111.111), scales float32. A tile is a set of elements that share a scale:
//   row tiles   1 x 128 along the last (contraction) dimension of x [M, K]:
//               scales [M, ceil(K / 128)];
//   blocks      128 x 128 of each w[g] [K, N]: scales [G, ceil(K / 128), ceil(N / 128)].
// A tail shorter than 128 (K or N not a multiple of 128) is a partial tile with its own
// scale. Per tile, in float32, with fl() one IEEE round-to-nearest-even operation:
//
//   m(x)   = |x| if x is finite and |x| >= 2^-126 (a normal float32), else 0
//   amax   = max over the tile of m(x)                        (0 for an empty/all-0 tile)
//   scale  = 1                                   if amax == 0
//            max(fl(amax / 448), 2^-126)         otherwise
//   pow2 scale: the smallest power of two >= that scale (exact rescaling, as MX formats)
//   q(x)   = 0x7f                                if x is NaN (NaN stays NaN, one code)
//            e4m3(fl(x' / scale))                otherwise, x' = x with float32-subnormal
//                                                values replaced by a zero of their sign
//   e4m3(v): round to nearest, ties to even, to E4M3; |v| > 448 (+-inf included) saturates
//            to +-448; results below the smallest subnormal round to a signed zero.
//
// Why each choice, so that the CPU kernel, the CUDA kernel and the jnp reference agree
// bitwise on every input:
// - The quotient is one correctly rounded float32 division x' / scale (not x * (1/scale),
//   which rounds twice), then one rounding to E4M3: host `/`, device __fdiv_rn, jnp `/`.
// - XLA's CPU runtime runs with denormals flushed (FTZ/DAZ) and GPUs do not. Flushing
//   float32-subnormal inputs (|x| < 2^-126, which bf16 and f32 can hold) to signed zero and
//   keeping the scale at or above 2^-126 (a normal number) make every operand of the
//   division normal; a subnormal quotient rounds to a signed zero in E4M3 either way.
//   Both rules differ from "scale = amax / 448" only for amax < 448 * 2^-126 (~5e-36).
// - NaN is caught before the division and always gives the code 0x7f: the sign of a NaN
//   is not kept by every platform (a GPU division returns a sign-less NaN, and XLA:GPU's
//   conversion to float8_e4m3fn canonicalises NaN), so no result may depend on it.
// - The classification m(x), the power-of-two rounding and the E4M3 rounding are integer
//   operations on the float32 bits (fp8_e4m3_from_float below), identical on host and
//   device; GPUs that have it (8.9 and later) round with the cvt.rn.satfinite instruction,
//   which gives the same bits, and sm_80 (which lacks it) takes the integer path.
#ifndef MOE_XLA_COMMON_FP8_BLOCKWISE_H_
#define MOE_XLA_COMMON_FP8_BLOCKWISE_H_

#include <cmath>
#include <cstdint>
#include <cstring>

#include "common/expert_activation.h"
#include "common/grouped_gemm.h"  // DType, MOE_XLA_HOST_DEVICE

namespace moe_xla {
namespace fp8 {

constexpr int64_t kTile = 128;            // tile edge along every tiled dimension
constexpr float kE4M3Max = 448.0f;        // largest finite float8_e4m3fn
constexpr uint8_t kE4M3MaxBits = 0x7e;    // 448 = 1.75 * 2^8: exponent 15, mantissa 6
constexpr uint8_t kE4M3NanBits = 0x7f;
constexpr uint32_t kMinNormalBits = 0x00800000u;  // 2^-126, the smallest normal float32
constexpr uint32_t kInfBits = 0x7f800000u;

// Number of tiles of edge kTile covering n elements (a tail forms a partial tile).
MOE_XLA_HOST_DEVICE inline int64_t tiles(int64_t n) { return (n + kTile - 1) / kTile; }

MOE_XLA_HOST_DEVICE inline uint32_t float_bits(float f) {
  uint32_t b;
  memcpy(&b, &f, sizeof b);
  return b;
}

MOE_XLA_HOST_DEVICE inline float bits_float(uint32_t b) {
  float f;
  memcpy(&f, &b, sizeof f);
  return f;
}

// m(x): |x| for a finite normal x, else 0 (NaN, +-inf and subnormals do not count).
MOE_XLA_HOST_DEVICE inline float tile_magnitude(float x) {
  const uint32_t a = float_bits(x) & 0x7fffffffu;
  return (a >= kMinNormalBits && a < kInfBits) ? bits_float(a) : 0.0f;
}

// The scale of a tile from its amax (a maximum of tile_magnitude values).
MOE_XLA_HOST_DEVICE inline float scale_from_amax(float amax, bool pow2) {
  if (amax == 0.0f) return 1.0f;
#if defined(__CUDA_ARCH__)
  uint32_t s = float_bits(__fdiv_rn(amax, kE4M3Max));
#else
  uint32_t s = float_bits(amax / kE4M3Max);
#endif
  if (s < kMinNormalBits) s = kMinNormalBits;  // subnormal (or flushed to 0) -> 2^-126
  if (pow2 && (s & 0x007fffffu) != 0) s = (s & 0x7f800000u) + kMinNormalBits;  // next exponent
  return bits_float(s);
}

// e4m3(v): round to nearest even to float8_e4m3fn bits, saturating to +-448; NaN -> the
// NaN code 0x7f. Integer operations; on GPUs with FP8 conversion (compute capability 8.9
// and later) the one instruction cvt.rn.satfinite.e4m3x2.f32, which rounds the same way
// (round to nearest even, +-inf and overflow to +-448, gradual underflow to a signed
// zero; the GPU tests compare both with the host's bits).
MOE_XLA_HOST_DEVICE inline uint8_t fp8_e4m3_from_float(float v) {
  const uint32_t bits = float_bits(v);
  const uint8_t sign = static_cast<uint8_t>((bits >> 24) & 0x80u);
  const uint32_t a = bits & 0x7fffffffu;
  if (a > kInfBits) return kE4M3NanBits;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  (void)sign;
  unsigned short pair;  // (e4m3(0), e4m3(v)): v in the low byte
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(pair) : "f"(0.0f), "f"(v));
  return static_cast<uint8_t>(pair & 0xffu);
#else
  if (a > float_bits(kE4M3Max)) return sign | kE4M3MaxBits;  // saturate, +-inf included
  if (a >= (121u << 23)) {
    // Normal E4M3 (|v| >= 2^-6): keep 3 of the 23 mantissa bits, ties to even; a carry
    // rolls into the exponent. Rebias 127 -> 7: subtract (127 - 7) << 3 after the shift.
    const uint32_t rounded = a + 0x7ffffu + ((a >> 20) & 1u);
    return sign | static_cast<uint8_t>((rounded >> 20) - (120u << 3));
  }
  if (a < kMinNormalBits) return sign;  // float32 subnormal or zero: far below 2^-10
  // Subnormal E4M3: q = RNE(|v| * 2^9) in units of 2^-9 (q = 8 is the smallest normal,
  // code 0x08). |v| = man * 2^(e - 150) with the implicit bit in man, so
  // |v| * 2^9 = man / 2^shift with shift = 141 - e (>= 21 here).
  const uint32_t man = (a & 0x007fffffu) | 0x00800000u;
  const uint32_t shift = 141u - (a >> 23);
  if (shift > 25) return sign;  // |v| * 2^9 < 2^-2 rounds to 0
  const uint32_t q = (man + (1u << (shift - 1)) - 1u + ((man >> shift) & 1u)) >> shift;
  return sign | static_cast<uint8_t>(q);
#endif
}

// q(x) for one element with its tile's scale (the per-element function of both kernel
// families).
MOE_XLA_HOST_DEVICE inline uint8_t quantize_element(float x, float scale) {
  const uint32_t bits = float_bits(x);
  const uint32_t a = bits & 0x7fffffffu;
  if (a > kInfBits) return kE4M3NanBits;
  if (a < kMinNormalBits) x = bits_float(bits & 0x80000000u);  // subnormal -> signed zero
#if defined(__CUDA_ARCH__)
  return fp8_e4m3_from_float(__fdiv_rn(x, scale));
#else
  return fp8_e4m3_from_float(x / scale);
#endif
}

// The quotient of q(x) without a division per element (the GPU kernels): with
// inverse = fl(1 / scale), one correctly rounded division per tile,
//   q0 = fl(x * inverse),   r = fl(x - scale * q0),   v = fl(q0 + r * inverse)
// (r and v by fused multiply-adds) and x's sign or'ed into v. v == fl(x / scale) wherever
// scale >= kFastScaleMin and |x / scale| >= 2^-22:
//  - every step then scales exactly with the exponents of x and scale, so v depends on
//    their significands only: 1 / scale (scale < 2^120: amax / 448), q0 and v are normal,
//    and the exact x - scale * q0 is a multiple of ulp(scale) * ulp(q0) >= 2^-103 * 2^-46,
//    so below 2^-126 it is a float32 subnormal (exact) and above it rounds as it would at
//    any exponent;
//  - Markstein's theorem (q0 within one ulp of x / scale, inverse within half an ulp of
//    1 / scale: r exact and v correctly rounded) covers the pairs whose x significand is at
//    least scale's, not all the others (q0 up to 1.5 ulps off and r inexact: x significand
//    0x1.fffffa, scale's 0x1.fffffe): tests/cc/fast_quotient_selftest.cu --exhaustive compares v
//    with the division for all 2^46 pairs of significands on a GPU, and
//    tests/cc/cpu_fp8_quantize_test.cc every x significand against the scales' extremes.
// Smaller quotients, float32-subnormal x included, give |v| < 2^-20 (each step's error is
// far below that), which like q(x) codes as the zero of x's sign (E4M3's least step is
// 2^-9). So e4m3(fast_quotient(x, ...)) == q(x) for every finite x. NaN and inf take
// quantize_element.
constexpr float kFastScaleMin = 0x1p-80f;

MOE_XLA_HOST_DEVICE inline float tile_inverse(float scale) {
#if defined(__CUDA_ARCH__)
  return __frcp_rn(scale);
#else
  return 1.0f / scale;
#endif
}

MOE_XLA_HOST_DEVICE inline float fast_quotient(float x, float scale, float inverse) {
#if defined(__CUDA_ARCH__)
  const float q0 = __fmul_rn(x, inverse);
  const float v = __fmaf_rn(__fmaf_rn(-scale, q0, x), inverse, q0);
#else
  const float q0 = x * inverse;
  const float v = std::fma(std::fma(-scale, q0, x), inverse, q0);
#endif
  return bits_float(float_bits(v) | (float_bits(x) & 0x80000000u));
}

// The value of float8_e4m3fn bits (for tests and dequantisation): NaN for 0x7f / 0xff.
MOE_XLA_HOST_DEVICE inline float fp8_e4m3_to_float(uint8_t q) {
  const uint32_t sign = uint32_t{q & 0x80u} << 24;
  const uint32_t e = (q >> 3) & 0xfu, m = q & 7u;
  if (e == 0xf && m == 7) return bits_float(sign | 0x7fc00000u);
  if (e == 0) return bits_float(sign | float_bits(static_cast<float>(m) * 0.001953125f));  // m * 2^-9
  return bits_float(sign | ((e + 120u) << 23) | (m << 20));
}

}  // namespace fp8

// Quantisation of x [batch, rows, cols] (dense row-major) in tiles of tile_rows x 128:
// tile_rows = 1 gives the 1 x 128 row tiles, tile_rows = 128 the 128 x 128 blocks.
//   q      [batch, rows, cols]                                 float8_e4m3fn bits
//   scales [batch, ceil(rows / tile_rows), ceil(cols / 128)]   float32
//   q_t    [batch, cols, rows]  (blocks only, optional) q with its last two axes swapped:
//          the two layouts of expert weights (the forward's and the dgrad's) in one pass
struct Fp8QuantizeParams {
  const void* x;
  DType dtype;      // of x
  uint8_t* q;
  uint8_t* q_t;     // nullptr: not written; tile_rows 128 only
  float* scales;
  int64_t batch;
  int64_t rows;
  int64_t cols;
  int64_t tile_rows;  // 1 or fp8::kTile
  bool pow2_scale;
};

// Quantisation of x [rows, cols] in 128 x 1 tiles along the rows that restart at every
// group boundary, written transposed: the operands of the FP8 wgrad (common/
// fp8_grouped_gemm.h, Fp8WgradParams), which contracts over each group's rows.
//   segments  the G groups' rows, clamped to `rows` as common/grouped_gemm.h says, then
//             the rows past the last group: G + 1 segments [start_s, end_s);
//   tiles     segment s is cut into ceil(len_s / 128) tiles of 128 rows from start_s;
//             tiles are numbered in row order, first_tile(s) = sum_{s' < s} ceil(len_s' / 128);
//             T = ceil(rows / 128) + G bounds their count.
//   q_t    [cols, 128 T]  float8_e4m3fn bits: x[r, c] (r in tile t of segment s) at
//                         q_t[c, 128 t + (r - start_s) % 128]; columns of no row hold 0
//   scales [T, cols]      float32: the scale of tile t in column c, from the amax of
//                         x[r, c] over the tile's rows; 1 for tiles of no row
// Each tile's scale and elements follow the rules above (amax, scale, q), so a column
// tile and a row tile of the same 128 values quantise alike. Group g's rows start at
// column 128 first_tile(g) of q_t (a 128-byte aligned offset: what TMA needs) and fill
// ceil(len_g / 128) whole tiles, zero past the group.
// With q given, the kernels also write x's 1 x 128 row tiles as Fp8QuantizeParams does
// (tile_rows 1), from the same read of x:
//   q          [rows, cols]              float8_e4m3fn bits
//   row_scales [rows, ceil(cols / 128)]  float32
// so that the FP8 dgrad's and the FP8 wgrad's operands of one x come from one pass.
// With source kGathered, the rows are gathered from token rows x [values_rows, cols] and
// nothing else is read: the expansion of Fp8ExpandQuantizeParams with the rows named by
// their sources instead of by slots, fused with the column tiles of its output,
//   w[r]  = x[sources[r]] if 0 <= sources[r] < values_rows, else a row of +0
//   row tiles    of u[r, c] = rnd(scaled_element(1, w[r, c]))
//   column tiles of v[r, c] = rnd(scaled_element(factor[r], w[r, c]))   (factor null: v = u)
// rnd the one rounding to dtype, so with each row named once the result is bitwise that
// of Fp8ExpandQuantizeParams' (q, scales) and of the column tiles of its out: the FP8
// wgrad's operands of permuted rows without the permuted copy in memory.
// With source kActivated, the rows are the expert activation of h = x [rows, 2 cols]
// (gated: gate | up) or [rows, cols]: u = v = a, a = rnd(activate(h)) as
// Fp8ActivateQuantizeParams computes it (common/expert_activation.h), so the result is
// bitwise that kernel's (q, scales) and the column tiles of its a, with a never written:
// the FP8 wgrad's operands of the second product's lhs.
enum class GroupColsRows : int32_t { kStored, kGathered, kActivated };

struct Fp8GroupColsParams {
  const void* x;               // [rows, cols]; [values_rows, cols] gathered; h activated
  DType dtype;                 // of x: f32, bf16 or f16
  const int32_t* group_sizes;  // [num_groups]; device memory for CUDA kernels
  int64_t num_groups;
  uint8_t* q_t;                // [cols, 128 T]
  float* scales;               // [T, cols]
  uint8_t* q;                  // [rows, cols], or null: no row tiles (then row_scales is null too)
  float* row_scales;           // [rows, ceil(cols / 128)]
  int64_t rows;
  int64_t cols;
  bool pow2_scale;
  // Where the rows come from; every source but kStored needs q. The fields below are read
  // for the sources named beside them (device memory for CUDA kernels) and are null
  // otherwise.
  GroupColsRows source = GroupColsRows::kStored;
  const int32_t* sources = nullptr;  // kGathered: [rows]
  const float* factor = nullptr;     // kGathered: [rows], or null: every factor 1
  int64_t values_rows = 0;           // kGathered: x's rows
  Activation activation = Activation::kSwiglu;  // kActivated
};

// T of Fp8GroupColsParams: the number of 128-row tiles the q_t / scales arrays hold.
MOE_XLA_HOST_DEVICE inline int64_t group_col_tiles(int64_t rows, int64_t num_groups) {
  return fp8::tiles(rows) + num_groups;
}

// The expansion of token rows into (token, expert) rows, scaled, fused with the 1 x 128 row
// quantisation of the unscaled rows: in the MoE backward row slots[t, j] of out is the
// cotangent of token t's j-th pair weighted, factor[t, j] * ct[t] (the bf16 wgrad's
// operand), and of q the unweighted ct[t] (the FP8 dgrad's: the routing weight enters later,
// in the activation's backward). Pair p = t * top_k + j names row slots[t, j]; entries
// outside [0, rows) name none.
//   values [num_values, cols] of dtype; slots, factor [num_values, top_k] int32 / float32
//   owner(r) = the largest p naming row r (none: -1), so each row has one writer
//   out    [rows, cols] of dtype: out[r, c] = rnd(scaled_element(factor[p], values[p / top_k, c]))
//          for p = owner(r) >= 0, +0 otherwise; rnd is the one rounding of the float32
//          product to dtype (RNE)
//   q, scales  quantize_fp8_rows(u), bitwise: [rows, cols], [rows, ceil(cols / 128)], of
//          the unscaled rows u[r, c] = rnd(scaled_element(1, values[p / top_k, c])) for
//          p = owner(r) >= 0 (values with magnitudes at most 2^-126 as zeros of their sign),
//          +0 otherwise: out's quantisation where the factors are 1
// Each token row is read once however many rows it fills. Where slots name every row
// once (permute's row map), out[slots[t, j]] = factor[t, j] * values[t].
// Without factor (a null pointer) every factor is 1: out is the unscaled rows u, the same
// bits as with factors of 1 (scaled_element(1, x) either way), which is not a plain copy
// of the token rows: entries of magnitude at most 2^-126 become zeros of their sign.
struct Fp8ExpandQuantizeParams {
  const void* values;
  DType dtype;           // of values and out
  const int32_t* slots;  // device memory for CUDA kernels, as factor
  const float* factor;   // [num_values, top_k], or null: every factor 1
  int64_t num_values;    // T
  int64_t top_k;
  void* out;
  uint8_t* q;
  float* scales;
  int64_t rows;          // R
  int64_t cols;
  bool pow2_scale;
};

namespace fp8 {

// x with a float32-subnormal value replaced by a zero of its sign.
MOE_XLA_HOST_DEVICE inline float flush_subnormal(float x) {
  const uint32_t bits = float_bits(x);
  return (bits & 0x7fffffffu) < kMinNormalBits ? bits_float(bits & 0x80000000u) : x;
}

// The float32 product of Fp8ExpandQuantizeParams: fl(s' * x'), s' and x' the operands with
// float32 subnormals flushed, and a product of magnitude at most 2^-126 replaced by a zero
// of its sign. XLA's CPU runtime multiplies with denormals flushed (FTZ/DAZ), GPUs do not,
// and the two disagree on products just below 2^-126 (x86 flushes one that gradual
// underflow rounds up to 2^-126); every mode gives a result of magnitude at most 2^-126
// there and the same result above, so this product is one on every platform.
MOE_XLA_HOST_DEVICE inline float scaled_element(float scale, float x) {
  const float p = flush_subnormal(scale) * flush_subnormal(x);
  const uint32_t bits = float_bits(p);
  return (bits & 0x7fffffffu) <= kMinNormalBits ? bits_float(bits & 0x80000000u) : p;
}

}  // namespace fp8

}  // namespace moe_xla

#endif  // MOE_XLA_COMMON_FP8_BLOCKWISE_H_
