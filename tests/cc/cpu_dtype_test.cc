// Exhaustive round trips of the bf16 / f16 conversions against their definitions.
#include <cmath>
#include <cstdio>

#include "cpu/dtype.h"

using namespace moe_xla::cpu;

int main() {
  int failures = 0;
  for (uint32_t h = 0; h < 0x10000u; ++h) {
    const float b = bf16_to_float(static_cast<uint16_t>(h));
    if (!std::isnan(b) && float_to_bf16(b) != h) ++failures;
    const float f = f16_to_float(static_cast<uint16_t>(h));
    if (std::isnan(f) != ((h & 0x7c00u) == 0x7c00u && (h & 0x3ffu) != 0)) ++failures;
    if (!std::isnan(f) && float_to_f16(f) != h) ++failures;
  }
  // Rounding: halfway cases go to even, large values overflow to inf.
  if (float_to_bf16(1.0f + 1.0f / 256) != 0x3f80u) ++failures;          // tie -> even (down)
  if (float_to_bf16(1.0f + 3.0f / 256) != 0x3f82u) ++failures;          // tie -> even (up)
  if (float_to_f16(1.0f + 1.0f / 2048) != 0x3c00u) ++failures;          // tie -> even
  if (float_to_f16(65520.0f) != 0x7c00u || float_to_f16(65504.0f) != 0x7bffu) ++failures;
  if (float_to_f16(std::ldexp(1.0f, -25)) != 0 || float_to_f16(std::ldexp(3.0f, -25)) != 2) ++failures;
  if (!std::isnan(bf16_to_float(float_to_bf16(NAN)))) ++failures;
  std::printf("%s: %d failures\n", failures ? "FAIL" : "PASS", failures);
  return failures ? 1 : 0;
}
