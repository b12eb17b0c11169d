// Host test of the tile scheduler's team order (team_order.h): for grids of 1 to 132
// clusters, team sizes and block lengths around every edge and unit counts from 0 to many
// waves, every unit goes to exactly one cluster, each cluster's units rise, each cluster
// gets as many units as in round robin, and inside a block a cluster steps by its team's
// size.
#include "cuda/team_order.h"

#include <cstdint>
#include <cstdio>
#include <vector>

namespace {

using moe_xla::cuda::TeamOrder;

int failures = 0;

void expect(bool ok, const char* what, uint64_t clusters, uint64_t units, uint64_t team,
            uint64_t waves) {
  if (ok) return;
  ++failures;
  if (failures <= 20) {
    std::printf("FAIL %s: clusters=%llu units=%llu team=%llu waves=%llu\n", what,
                (unsigned long long)clusters, (unsigned long long)units,
                (unsigned long long)team, (unsigned long long)waves);
  }
}

void check(uint64_t clusters, uint64_t units, uint64_t team, uint64_t waves) {
  std::vector<int> owners(units, 0);
  const bool teams = TeamOrder::has_teams(clusters, team, waves);
  bool rising = true, counts = true, in_range = true, team_steps = true;
  for (uint64_t q = 0; q < clusters; ++q) {
    const TeamOrder order(q, clusters, units, team, waves);
    const uint64_t team_size =
        teams ? (team < clusters - q / team * team ? team : clusters - q / team * team) : 0;
    const uint64_t whole_block_steps = teams ? units / (clusters * waves) * waves : 0;
    uint64_t taken = 0, previous = 0;
    for (uint64_t k = 0;; ++k) {
      const uint64_t u = order.unit(k);
      if (u == TeamOrder::kEnd) break;
      if (u >= units) {
        in_range = false;
        break;
      }
      ++owners[u];
      if (k > 0 && u <= previous) rising = false;
      if (teams && k > 0 && k < whole_block_steps && k % waves != 0 &&
          u - previous != team_size) {
        team_steps = false;
      }
      previous = u;
      ++taken;
    }
    if (taken != units / clusters + (q < units % clusters ? 1 : 0)) counts = false;
  }
  bool once = true;
  for (int n : owners) once = once && n == 1;
  expect(in_range, "unit out of range", clusters, units, team, waves);
  expect(once, "every unit taken exactly once", clusters, units, team, waves);
  expect(rising, "units rise step by step", clusters, units, team, waves);
  expect(counts, "units per cluster as in round robin", clusters, units, team, waves);
  expect(team_steps, "a team's cluster steps by the team size inside a block", clusters,
         units, team, waves);
}

}  // namespace

int main() {
  int cases = 0;
  for (uint64_t clusters : {1, 2, 5, 66, 132}) {
    for (uint64_t team : {0, 1, 3, 4, 8, 16, 33, 65, 66, 200}) {
      for (uint64_t waves : {0, 1, 2, 3, 8}) {
        for (uint64_t units : {uint64_t{0}, uint64_t{1}, clusters - 1, clusters, clusters + 1,
                               2 * clusters * waves, 2 * clusters * waves + 7,
                               7 * clusters + 3, 100 * clusters + 17}) {
          check(clusters, units, team, waves);
          ++cases;
        }
      }
    }
  }
  // Round robin with the count unknown: the caller ends the sequence.
  const TeamOrder unknown(5, 66, TeamOrder::kEnd, 0, 1);
  expect(unknown.unit(1000) == 5 + 1000 * 66, "round robin without a count", 66, 0, 0, 1);
  std::printf("%s: %d failures in %d cases\n", failures ? "FAILED" : "OK", failures, cases);
  return failures ? 1 : 0;
}
