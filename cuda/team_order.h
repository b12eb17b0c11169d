// The team order of the grouped GEMM's tile scheduler as plain integer arithmetic: which
// units of CUTLASS's tile sequence one cluster takes, step by step. Host and device code;
// used by team_scheduler.cuh on the GPU and tested on the host (tests/cc/team_order_test.cc).
//
// C clusters share U units (a unit = one cluster's worth of output tiles, in CUTLASS's
// sequence: group by group, each group in its raster order).
//   Round robin (CUTLASS's own order): cluster q takes q, q + C, q + 2C, ...
//   Team order (S clusters per team, W waves per block): the sequence is cut into blocks
//   of W * C units. In each block, team j (clusters j*S .. j*S + S_j - 1, S_j = S except
//   for a smaller last team) takes the S_j * W units from unit j*S*W of the block on, and
//   its cluster r takes r, r + S_j, ..., r + (W - 1) S_j of them. The units after the last
//   whole block go round robin. Every cluster gets floor(U / C) units, one more when
//   q < U mod C, as in round robin; its units rise step by step.
#ifndef MOE_XLA_CUDA_TEAM_ORDER_H_
#define MOE_XLA_CUDA_TEAM_ORDER_H_

#include <cstdint>

#include "common/grouped_gemm.h"  // MOE_XLA_HOST_DEVICE

namespace moe_xla {
namespace cuda {

class TeamOrder {
 public:
  static constexpr uint64_t kEnd = ~uint64_t{0};

  // Whether `team` clusters per team and `waves` per block make a team order on a grid of
  // `clusters`; otherwise (team = 0, team >= clusters or waves <= 1) it is round robin.
  MOE_XLA_HOST_DEVICE static bool has_teams(uint64_t clusters, uint64_t team, uint64_t waves) {
    return team > 0 && team < clusters && waves > 1;
  }

  // Cluster `cluster` of `clusters`, `units` in all (kEnd: unknown, round robin only: the
  // caller ends the sequence), `team` clusters per team and `waves` per block.
  MOE_XLA_HOST_DEVICE TeamOrder(uint64_t cluster, uint64_t clusters, uint64_t units,
                                uint64_t team, uint64_t waves)
      : clusters_(clusters), units_(units), tail_first_(cluster) {
    if (!has_teams(clusters, team, waves)) return;
    const uint64_t team_start = cluster / team * team;
    waves_ = waves;
    block_units_ = clusters * waves;
    team_size_ = team < clusters - team_start ? team : clusters - team_start;
    in_block_ = team_start * waves + (cluster - team_start);
    block_steps_ = units / block_units_ * waves;
    tail_first_ = units / block_units_ * block_units_ + cluster;
  }

  // The unit of step k, or kEnd past the cluster's last one.
  MOE_XLA_HOST_DEVICE uint64_t unit(uint64_t k) const {
    if (k < block_steps_) return k / waves_ * block_units_ + in_block_ + k % waves_ * team_size_;
    const uint64_t u = tail_first_ + (k - block_steps_) * clusters_;
    return u < units_ ? u : kEnd;
  }

 private:
  uint64_t clusters_;
  uint64_t units_;
  uint64_t tail_first_;       // the cluster's first unit after the whole blocks
  uint64_t waves_ = 1;
  uint64_t block_units_ = 0;
  uint64_t team_size_ = 0;
  uint64_t in_block_ = 0;     // the cluster's first unit in every block
  uint64_t block_steps_ = 0;  // steps spent in whole blocks
};

}  // namespace cuda
}  // namespace moe_xla

#endif  // MOE_XLA_CUDA_TEAM_ORDER_H_
