// CPU dispatch plan: one pass over the tokens (ep_row_places first fills source and
// pairs, then each token writes its rows' entries).
#include "cpu/ep_plan.h"

#include <cstdint>

namespace moe_xla::cpu {

void ep_dedup_rows(const EpDedupRowsParams& p) {
  for (int64_t t = 0; t < p.dims.tokens; ++t) ep_plan::dedup_token(p, t);
}

void ep_row_places(const EpRowPlacesParams& p) {
  const int64_t rows = p.dims.tokens * p.dims.top_k;
  const int32_t none = static_cast<int32_t>(p.dims.tokens * p.dims.rows_per_token);
  for (int64_t r = 0; r < rows; ++r) {
    p.source[r] = none;
    p.pairs[r] = 0;
  }
  for (int64_t t = 0; t < p.dims.tokens; ++t) ep_plan::place_token(p, t);
}

}  // namespace moe_xla::cpu
