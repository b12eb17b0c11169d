// Tile scheduler of the CUTLASS grouped GEMMs: CUTLASS 4.2's persistent sm90 group
// scheduler with the units of its tile sequence dealt out in the team order of
// team_order.h instead of round robin over the whole grid.
//
// CUTLASS numbers the output tiles of all groups in one sequence (group by group, each in
// its raster order, counted in whole clusters) and gives cluster q of C clusters the units
// q, q + C, q + 2C, ... When a group has fewer than C units, every step of a cluster lands
// in another group, and each change of group rewrites the TMA descriptors of A, B and D on
// the device (tensormap update, copy to global memory, release and acquire fences) before
// the next tile can load. In the team order, a team of S clusters walks a stretch of
// S * W units (W waves) together, so a cluster stays in one group for about (units of the
// group) / S steps, while every region of the sequence (large groups, or many small ones)
// is still spread over all teams block by block.
//
// Each cluster's units rise step by step, which CUTLASS's forward-only walk over the
// groups relies on; the walk, the tile coordinates inside a group and the work-tile
// pipeline are CUTLASS's.
#ifndef MOE_XLA_CUDA_TEAM_SCHEDULER_CUH_
#define MOE_XLA_CUDA_TEAM_SCHEDULER_CUH_

#include <cstdint>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/tile_scheduler.hpp"
#include "cuda/team_order.h"

namespace moe_xla {
namespace cuda {
namespace detail {

// CUTLASS's device-side group problem shapes plus the team order's S and W. A type of its
// own, so that CUTLASS's scheduler selector (specialised below) picks TeamGroupScheduler.
struct TeamGroupShape : cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>> {
  int team_clusters = 0;  // S
  int team_waves = 0;     // W
};

template <int kStages>
class TeamGroupScheduler
    : public cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90Group<TeamGroupShape,
                                                                             kStages> {
  using Base =
      cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90Group<TeamGroupShape, kStages>;

 public:
  using typename Base::Params;
  using typename Base::SchedulerResponse;
  using typename Base::WorkTileInfo;

  TeamGroupScheduler() = default;

  // Every thread of the CTA constructs one (whole warps): the units of this CTA's cluster.
  CUTLASS_DEVICE TeamGroupScheduler(Params const& params, SchedulerResponse* response)
      : Base(params, response) {
#if defined(__CUDA_ARCH__)
    const uint64_t cluster_size =
        static_cast<uint64_t>(params.cluster_shape_.m()) * params.cluster_shape_.n();
    // The CTA's place in CUTLASS's sequence (as the base class numbers it): cluster q,
    // position p in the cluster.
    const uint64_t cta = params.raster_order_ == Base::RasterOrder::AlongN
                             ? uint64_t(blockIdx.x) + uint64_t(blockIdx.y) * gridDim.x
                             : uint64_t(blockIdx.x) * gridDim.y + uint64_t(blockIdx.y);
    const uint64_t clusters = uint64_t(gridDim.x) * gridDim.y * gridDim.z / cluster_size;
    cluster_size_ = cluster_size;
    position_ = cta % cluster_size;
    // Negative fields (never passed by the dispatcher) read as round robin.
    const uint64_t team = static_cast<uint64_t>(cute::max(params.problem_shapes_.team_clusters, 0));
    const uint64_t waves = static_cast<uint64_t>(cute::max(params.problem_shapes_.team_waves, 0));
    // Round robin needs no count: CUTLASS's group walk ends the sequence.
    const uint64_t units =
        TeamOrder::has_teams(clusters, team, waves) ? total_units(params) : TeamOrder::kEnd;
    order_ = TeamOrder(cta / cluster_size, clusters, units, team, waves);
#endif
  }

  template <class ClusterShape>
  CUTLASS_DEVICE WorkTileInfo initial_work_tile_info(ClusterShape) {
    return work_at(0);
  }

  // As CUTLASS's: the scheduler warp computes the next work tile and hands it to the other
  // warps through the shared-memory pipeline.
  template <class Pipeline, class PipelineState>
  CUTLASS_DEVICE auto advance_to_next_work(Pipeline& pipeline, PipelineState state,
                                           uint32_t advance_count = 1) {
    step_ += advance_count;
    const WorkTileInfo work = work_at(step_);
    pipeline.producer_acquire(state);
    if (cute::elect_one_sync()) {
      this->response_ptr_[state.index()] = work;
      cutlass::arch::fence_view_async_shared();
      pipeline.producer_commit(state);
    }
    return cute::make_tuple(work, true);
  }

 private:
  // Sum over the groups of their tiles (CUTLASS's count: tiles along M and N, each rounded
  // up to whole clusters and swizzle blocks), in units; one warp reads all shapes.
  CUTLASS_DEVICE static uint64_t total_units(Params const& params) {
    const int lanes = cutlass::NumThreadsPerWarp;
    const uint64_t round_m = (uint64_t{1} << params.log_swizzle_size_) * params.cluster_shape_.m();
    const uint64_t round_n = (uint64_t{1} << params.log_swizzle_size_) * params.cluster_shape_.n();
    uint64_t tiles = 0;
    for (int g = cutlass::canonical_lane_idx(); g < params.problem_shapes_.groups(); g += lanes) {
      const auto shape = params.problem_shapes_.get_problem_shape(g);
      const uint64_t m = cute::ceil_div(static_cast<uint64_t>(cute::get<0>(shape)),
                                        static_cast<uint64_t>(params.cta_shape_.m()));
      const uint64_t n = cute::ceil_div(static_cast<uint64_t>(cute::get<1>(shape)),
                                        static_cast<uint64_t>(params.cta_shape_.n()));
      tiles += cute::round_up(m, round_m) * cute::round_up(n, round_n);
    }
    for (int offset = lanes / 2; offset > 0; offset /= 2) {
      tiles += __shfl_xor_sync(0xffffffff, tiles, offset);
    }
    return tiles / (static_cast<uint64_t>(params.cluster_shape_.m()) * params.cluster_shape_.n());
  }

  // The work tile of this CTA's step k (invalid past its last unit).
  CUTLASS_DEVICE WorkTileInfo work_at(uint64_t k) {
    const uint64_t unit = order_.unit(k);
    if (unit == TeamOrder::kEnd) return WorkTileInfo::invalid_work_tile();
    return this->get_current_work_for_linear_idx(unit * cluster_size_ + position_);
  }

  TeamOrder order_{0, 1, TeamOrder::kEnd, 0, 1};
  uint64_t cluster_size_ = 1;
  uint64_t position_ = 0;
  uint64_t step_ = 0;
};

}  // namespace detail
}  // namespace cuda
}  // namespace moe_xla

// CUTLASS picks a kernel's tile scheduler through this selector; for our problem shape type
// it is the team scheduler.
namespace cutlass::gemm::kernel::detail {
template <class TileShape, class ClusterShape, uint32_t kStages>
struct TileSchedulerSelector<GroupScheduler, arch::Sm90, TileShape, ClusterShape, kStages,
                             moe_xla::cuda::detail::TeamGroupShape> {
  using Scheduler = moe_xla::cuda::detail::TeamGroupScheduler<static_cast<int>(kStages)>;
};
}  // namespace cutlass::gemm::kernel::detail

#endif  // MOE_XLA_CUDA_TEAM_SCHEDULER_CUH_
