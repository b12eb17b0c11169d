// CPU FP8 blockwise quantisation in tiles of tile_rows x 128 (contract in
// common/fp8_blockwise.h).
#ifndef MOE_XLA_CPU_FP8_QUANTIZE_H_
#define MOE_XLA_CPU_FP8_QUANTIZE_H_

#include "common/fp8_blockwise.h"

namespace moe_xla::cpu {

// Fills p.q and p.scales (host memory). Expects p.tile_rows of 1 or 128 and
// non-negative sizes (the handlers check both).
void fp8_quantize(const Fp8QuantizeParams& p);

}  // namespace moe_xla::cpu

#endif  // MOE_XLA_CPU_FP8_QUANTIZE_H_
