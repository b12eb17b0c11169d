// The float32 value of every float8_e4m3fn code, for the CPU FP8 products: one table
// lookup per operand element instead of fp8::fp8_e4m3_to_float's bit operations.
#ifndef MOE_XLA_CPU_FP8_DECODE_H_
#define MOE_XLA_CPU_FP8_DECODE_H_

#include <array>
#include <cstdint>

#include "common/fp8_blockwise.h"

namespace moe_xla::cpu {

// table[c] = e(c), NaN for the NaN codes 0x7f and 0xff; built once per process.
inline const std::array<float, 256>& e4m3_table() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int c = 0; c < 256; ++c) t[c] = fp8::fp8_e4m3_to_float(static_cast<uint8_t>(c));
    return t;
  }();
  return table;
}

}  // namespace moe_xla::cpu

#endif  // MOE_XLA_CPU_FP8_DECODE_H_
