// CPU gather_rows: out[r] = factor[r] * values[src[r]] (a copy without factor), a zero row
// where src[r] names no row. See common/gather_rows.h for the contract.
#ifndef MOE_XLA_CPU_GATHER_ROWS_H_
#define MOE_XLA_CPU_GATHER_ROWS_H_

#include "common/gather_rows.h"

namespace moe_xla::cpu {

// Fills p.out (host memory). Any src content is accepted.
void gather_rows(const GatherRowsParams& p);

}  // namespace moe_xla::cpu

#endif  // MOE_XLA_CPU_GATHER_ROWS_H_
