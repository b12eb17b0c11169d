// CPU kernels of the EP layer's dispatch plan: ep_dedup_rows and ep_row_places, token by
// token with the functions of common/ep_plan.h (the contract).
#ifndef MOE_XLA_CPU_EP_PLAN_H_
#define MOE_XLA_CPU_EP_PLAN_H_

#include "common/ep_plan.h"

namespace moe_xla::cpu {

// Fill p.row_dest, p.lids and p.weight_slot (host memory). Any dest and lid are accepted.
void ep_dedup_rows(const EpDedupRowsParams& p);

// Fill p.dest_rows, p.row, p.source and p.pairs (host memory). Any content is accepted.
void ep_row_places(const EpRowPlacesParams& p);

}  // namespace moe_xla::cpu

#endif  // MOE_XLA_CPU_EP_PLAN_H_
