// CPU dispatch: counting sort (histogram, exclusive scan, scatter in assignment order);
// row_pairs is written with row_map, as its inverse.
#include "cpu/permute.h"

#include <cstdint>
#include <cstring>
#include <vector>

namespace moe_xla::cpu {

void permute(const PermuteParams& p) {
  const int64_t T = p.tokens, k = p.top_k, E = p.experts, H = p.hidden;
  const int64_t n = T * k;
  // Bucket E collects the invalid assignments, after every group.
  auto bucket = [&](int64_t i) -> int64_t {
    const int32_t e = p.expert_ids[i];
    return e >= 0 && e < E ? e : E;
  };
  std::vector<int64_t> next(E + 1, 0);
  for (int64_t i = 0; i < n; ++i) ++next[bucket(i)];
  for (int64_t e = 0; e < E; ++e) p.group_sizes[e] = static_cast<int32_t>(next[e]);
  int64_t offset = 0;
  for (int64_t e = 0; e <= E; ++e) {
    const int64_t count = next[e];
    next[e] = offset;
    offset += count;
  }
  const size_t row_bytes = static_cast<size_t>(H) * dtype_bytes(p.dtype);
  const auto* x = static_cast<const unsigned char*>(p.x);
  auto* x_sorted = static_cast<unsigned char*>(p.x_sorted);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t slot = next[bucket(i)]++;
    p.row_map[i] = static_cast<int32_t>(slot);
    p.row_pairs[slot] = static_cast<int32_t>(i);
    if (row_bytes) std::memcpy(x_sorted + slot * row_bytes, x + (i / k) * row_bytes, row_bytes);
  }
}

}  // namespace moe_xla::cpu
