// Scalar conversions between the storage dtypes (f32, bf16, f16) and float.
#ifndef MOE_XLA_CPU_DTYPE_H_
#define MOE_XLA_CPU_DTYPE_H_

#include <cstdint>
#include <cstring>

#include "common/grouped_gemm.h"

namespace moe_xla::cpu {

inline float bits_to_float(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline uint32_t float_to_bits(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  return bits;
}

inline float bf16_to_float(uint16_t h) { return bits_to_float(uint32_t{h} << 16); }

// Round to nearest even; NaN stays NaN.
inline uint16_t float_to_bf16(float f) {
  const uint32_t bits = float_to_bits(f);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);
  const uint32_t rounding = 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>((bits + rounding) >> 16);
}

inline float f16_to_float(uint16_t h) {
  const uint32_t sign = uint32_t{h & 0x8000u} << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t man = h & 0x3ffu;
  if (exp == 0x1f) return bits_to_float(sign | 0x7f800000u | (man << 13));  // inf / NaN
  if (exp != 0) return bits_to_float(sign | ((exp + 112u) << 23) | (man << 13));
  // Subnormal (or zero): man * 2^-24.
  const float magnitude = static_cast<float>(man) * 5.9604644775390625e-8f;
  return sign ? -magnitude : magnitude;
}

// Round to nearest even with overflow to inf and gradual underflow.
inline uint16_t float_to_f16(float f) {
  const uint32_t bits = float_to_bits(f);
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const uint32_t abs = bits & 0x7fffffffu;
  if (abs > 0x7f800000u) return sign | 0x7e00u;                  // NaN
  if (abs >= 0x477ff000u) return sign | 0x7c00u;                 // rounds to >= 65520: inf
  if (abs < 0x38800000u) {                                       // below 2^-14: subnormal
    const float scaled = bits_to_float(abs) * 16777216.0f;      // in units of 2^-24
    const uint32_t q = static_cast<uint32_t>(scaled);
    const float rem = scaled - static_cast<float>(q);
    const uint32_t r = q + ((rem > 0.5f || (rem == 0.5f && (q & 1u))) ? 1u : 0u);
    return sign | static_cast<uint16_t>(r);
  }
  const uint32_t rounded = abs + 0xfffu + ((abs >> 13) & 1u);
  return sign | static_cast<uint16_t>((rounded - 0x38000000u) >> 13);
}

inline float load_as_float(const void* base, int64_t i, DType t) {
  switch (t) {
    case DType::kF32: return static_cast<const float*>(base)[i];
    case DType::kBF16: return bf16_to_float(static_cast<const uint16_t*>(base)[i]);
    case DType::kF16: return f16_to_float(static_cast<const uint16_t*>(base)[i]);
  }
  return 0.0f;
}

inline void store_from_float(void* base, int64_t i, DType t, float v) {
  switch (t) {
    case DType::kF32: static_cast<float*>(base)[i] = v; break;
    case DType::kBF16: static_cast<uint16_t*>(base)[i] = float_to_bf16(v); break;
    case DType::kF16: static_cast<uint16_t*>(base)[i] = float_to_f16(v); break;
  }
}

// v rounded to t (RNE) and back to float32.
inline float round_to(float v, DType t) {
  switch (t) {
    case DType::kF32: return v;
    case DType::kBF16: return bf16_to_float(float_to_bf16(v));
    case DType::kF16: return f16_to_float(float_to_f16(v));
  }
  return v;
}

}  // namespace moe_xla::cpu

#endif  // MOE_XLA_CPU_DTYPE_H_
