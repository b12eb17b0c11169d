// Framework-free contracts of the EP layer's dispatch plan, shared by the CPU kernels
// (cpu/ep_plan.cc) and the CUDA kernels (cuda/ep_plan.cu). A rank's pairs (t, j) go to
// rank dest[t, j] (valid if in [0, P)), local expert slot lid[t, j] there; the plan says
// which rows the rank sends where. Both ops work token by token (the functions below),
// so the two kernel families run the same code.
//
// ep_dedup_rows: dest [T, k], lid [T, k] int32; P, L (local slots), M (mult), n = min(k, P)
//     -> row_dest [T, k], lids [T*n, M], weight_slot [T*k], weight_sources [T*n*M] int32
//   j is a first if dest[t, j] is valid and no j' < j of t has the same destination.
//   row_dest[t, j] = dest[t, j] at a first, else P (no row).
//   Row c of token t is its c-th first j_c (in j order; a token has at most n: its valid
//   destinations are distinct values in [0, P)). It asks for the slots of t's pairs with
//   dest[t, j_c], in j order: lids[t*n + c, m] = lid[t, j] of the m-th of them, m < M;
//   lids = L everywhere else (rows t does not have, m past its pairs).
//   weight_slot[t*k + j] = (t*n + c)*M + m where pair j is the m-th pair of row c, or -1
//   for an invalid destination or m >= M: the place of the pair's routing weight among
//   the rows' [T*n, M] weights. weight_sources is its inverse: weight_sources[s] = t*k + j
//   where weight_slot[t*k + j] = s, -1 at every place no pair fills.
//
// ep_row_places: row_dest [T, k], row_map [T*k], lids [T*n, M] int32; P, L, n
//     -> dest_rows [T, n], row [T, n], source [T*k], pairs [T*k] int32
//   row_map is permute's of row_dest over P experts (the rows grouped by destination);
//   without dedup row_dest is dest itself and lids [T*k, 1] (n = k, M = 1).
//   Row c of token t is the c-th j with row_dest[t, j] valid (j_c), for c < n.
//   dest_rows[t, c] = row_dest[t, j_c]; row[t, c] = r = row_map[t*k + j_c], its place
//   among the grouped rows, if r lies in [0, T*k), else T*k (no place). P and T*k where
//   t has fewer than c + 1 rows.
//   source[r] = t*n + c where r = row[t, c] lies in [0, T*k); T*n at every other r.
//   pairs[r] = #{m : 0 <= lids[t*n + c, m] < L} there; 0 at every other r.
//   permute's row_map names each grouped row once, so each r is written once. For a
//   row_map naming a row twice, which of its rows lands there is not specified; whatever
//   row_map holds, nothing outside the outputs is read or written.
#ifndef MOE_XLA_COMMON_EP_PLAN_H_
#define MOE_XLA_COMMON_EP_PLAN_H_

#include <cstdint>

#include "common/grouped_gemm.h"  // MOE_XLA_HOST_DEVICE

namespace moe_xla {

// The sizes both ops take.
struct EpPlanDims {
  int64_t tokens;          // T
  int64_t top_k;           // k
  int32_t peers;           // P
  int32_t local;           // L
  int64_t mult;            // M
  int64_t rows_per_token;  // n
};

struct EpDedupRowsParams {
  const int32_t* dest;     // [T, k]
  const int32_t* lid;      // [T, k]
  int32_t* row_dest;       // [T, k]
  int32_t* lids;           // [T*n, M]
  int32_t* weight_slot;    // [T*k]
  int32_t* weight_sources;  // [T*n*M]
  EpPlanDims dims;         // n = min(k, P)
};

struct EpRowPlacesParams {
  const int32_t* row_dest;  // [T, k]
  const int32_t* row_map;   // [T*k]
  const int32_t* lids;      // [T*n, M]
  int32_t* dest_rows;       // [T, n]
  int32_t* row;             // [T, n]
  int32_t* source;          // [T*k]
  int32_t* pairs;           // [T*k]
  EpPlanDims dims;
};

namespace ep_plan {

MOE_XLA_HOST_DEVICE inline bool valid_rank(int32_t d, int32_t peers) { return d >= 0 && d < peers; }

// ep_dedup_rows for token t: k^2 comparisons, no scratch memory.
MOE_XLA_HOST_DEVICE inline void dedup_token(const EpDedupRowsParams& p, int64_t t) {
  const int64_t k = p.dims.top_k, n = p.dims.rows_per_token, mult = p.dims.mult;
  const int32_t peers = p.dims.peers;
  const int32_t* dest = p.dest + t * k;
  const int32_t* lid = p.lid + t * k;
  int32_t* row_dest = p.row_dest + t * k;
  int32_t* lids = p.lids + t * n * mult;
  int32_t* weight_slot = p.weight_slot + t * k;
  int32_t* weight_sources = p.weight_sources + t * n * mult;
  for (int64_t i = 0; i < n * mult; ++i) {
    lids[i] = p.dims.local;
    weight_sources[i] = -1;
  }
  for (int64_t j = 0; j < k; ++j) {
    row_dest[j] = peers;
    weight_slot[j] = -1;
  }
  int64_t c = 0;  // rows so far; stays < n (distinct valid destinations)
  for (int64_t j = 0; j < k; ++j) {
    const int32_t d = dest[j];
    if (!valid_rank(d, peers)) continue;
    bool first = true;
    for (int64_t i = 0; i < j && first; ++i) first = dest[i] != d;
    if (!first) continue;  // its row is that of the earlier j, which placed it
    row_dest[j] = d;
    int64_t m = 0;
    for (int64_t i = j; i < k; ++i) {
      if (dest[i] != d) continue;
      if (m < mult) {
        lids[c * mult + m] = lid[i];
        weight_slot[i] = static_cast<int32_t>((t * n + c) * mult + m);
        weight_sources[c * mult + m] = static_cast<int32_t>(t * k + i);
      }
      ++m;
    }
    ++c;
  }
}

// ep_row_places for token t, after every source and pairs entry holds its fill (T*n, 0).
MOE_XLA_HOST_DEVICE inline void place_token(const EpRowPlacesParams& p, int64_t t) {
  const int64_t k = p.dims.top_k, n = p.dims.rows_per_token, mult = p.dims.mult, rows = p.dims.tokens * k;
  const int32_t peers = p.dims.peers, local = p.dims.local;
  const int32_t* row_dest = p.row_dest + t * k;
  int32_t* dest_rows = p.dest_rows + t * n;
  int32_t* row = p.row + t * n;
  int64_t c = 0;
  for (int64_t j = 0; j < k && c < n; ++j) {
    const int32_t d = row_dest[j];
    if (!valid_rank(d, peers)) continue;
    const int32_t r = p.row_map[t * k + j];
    const bool placed = r >= 0 && r < rows;
    dest_rows[c] = d;
    row[c] = placed ? r : static_cast<int32_t>(rows);
    if (placed) {
      const int32_t* asks = p.lids + (t * n + c) * mult;
      int32_t count = 0;
      for (int64_t m = 0; m < mult; ++m) count += asks[m] >= 0 && asks[m] < local;
      p.source[r] = static_cast<int32_t>(t * n + c);
      p.pairs[r] = count;
    }
    ++c;
  }
  for (; c < n; ++c) {
    dest_rows[c] = peers;
    row[c] = static_cast<int32_t>(rows);
  }
}

}  // namespace ep_plan
}  // namespace moe_xla

#endif  // MOE_XLA_COMMON_EP_PLAN_H_
