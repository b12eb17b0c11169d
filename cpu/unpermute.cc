// CPU combine: per token a float32 accumulator row, the k weighted rows added in j order.
#include "cpu/unpermute.h"

#include <algorithm>
#include <cstdint>
#include <vector>

#include "cpu/dtype.h"

namespace moe_xla::cpu {
namespace {

template <DType D>
float load(const void* base, int64_t i) {
  if constexpr (D == DType::kF32) {
    return static_cast<const float*>(base)[i];
  } else if constexpr (D == DType::kBF16) {
    return bf16_to_float(static_cast<const uint16_t*>(base)[i]);
  } else {
    return f16_to_float(static_cast<const uint16_t*>(base)[i]);
  }
}

template <DType D>
void unpermute_impl(const UnpermuteParams& p) {
  const int64_t T = p.tokens, k = p.top_k, H = p.hidden;
  const int64_t n = p.rows;
  std::vector<float> acc(H);
  for (int64_t t = 0; t < T; ++t) {
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int64_t j = 0; j < k; ++j) {
      const int64_t r = p.row_map[t * k + j];
      if (r < 0 || r >= n) continue;  // contributes 0
      const float w = p.weights == nullptr ? 1.0f : p.weights[t * k + j];
      for (int64_t h = 0; h < H; ++h) {
        const float product = w * load<D>(p.y_sorted, r * H + h);
        acc[h] = acc[h] + product;
      }
    }
    for (int64_t h = 0; h < H; ++h) store_from_float(p.y, t * H + h, D, acc[h]);
  }
}

}  // namespace

void unpermute(const UnpermuteParams& p) {
  switch (p.dtype) {
    case DType::kF32: return unpermute_impl<DType::kF32>(p);
    case DType::kBF16: return unpermute_impl<DType::kBF16>(p);
    case DType::kF16: return unpermute_impl<DType::kF16>(p);
  }
}

}  // namespace moe_xla::cpu
