// CPU FP8 blockwise quantisation in tiles of tile_rows x 128 (contract in
// common/fp8_blockwise.h).
#ifndef MOE_XLA_CPU_FP8_QUANTIZE_H_
#define MOE_XLA_CPU_FP8_QUANTIZE_H_

#include "common/expert_activation.h"
#include "common/fp8_blockwise.h"

namespace moe_xla::cpu {

// Fills p.q and p.scales (host memory). Expects p.tile_rows of 1 or 128 and
// non-negative sizes (the handlers check both).
void fp8_quantize(const Fp8QuantizeParams& p);

// Fills p.a, p.q and p.scales (host memory): the activation of h and its 1 x 128 row
// quantisation (common/expert_activation.h). Expects non-negative sizes.
void fp8_activate_quantize(const Fp8ActivateQuantizeParams& p);

// Fills p.dh, p.q and p.scales (host memory): the activation's backward and the 1 x 128
// row quantisation of d h (common/expert_activation.h). Expects non-negative sizes.
void fp8_activate_grad_quantize(const Fp8ActivateGradQuantizeParams& p);

}  // namespace moe_xla::cpu

#endif  // MOE_XLA_CPU_FP8_QUANTIZE_H_
