// CPU FP8 blockwise quantisation in tiles of tile_rows x 128, and in the 128 x 1 column
// tiles of the FP8 wgrad (contracts in common/fp8_blockwise.h).
#ifndef MOE_XLA_CPU_FP8_QUANTIZE_H_
#define MOE_XLA_CPU_FP8_QUANTIZE_H_

#include "common/expert_activation.h"
#include "common/fp8_blockwise.h"

namespace moe_xla::cpu {

// Fills p.q and p.scales (host memory), and p.q_t when it is not null (q with its last
// two axes swapped). Expects p.tile_rows of 1 or 128, p.q_t null unless 128, and
// non-negative sizes (the handlers check all three).
void fp8_quantize(const Fp8QuantizeParams& p);

// Fills p.a, p.q and p.scales (host memory): the activation of h and its 1 x 128 row
// quantisation (common/expert_activation.h). Expects non-negative sizes.
void fp8_activate_quantize(const Fp8ActivateQuantizeParams& p);

// Fills p.out, p.q and p.scales (host memory, p.slots and p.factor too): the token rows
// expanded into the rows p.slots names, scaled (p.factor null: every factor 1), and their
// 1 x 128 row quantisation (Fp8ExpandQuantizeParams in common/fp8_blockwise.h). Expects
// non-negative sizes and num_values < 2^31.
void fp8_expand_quantize(const Fp8ExpandQuantizeParams& p);

// Fills p.q_t and p.scales (host memory, p.group_sizes too): x in 128 x 1 column tiles that
// restart at every group boundary, transposed; columns of no row 0, scales of no tile 1;
// with p.q, p.q and p.row_scales: x's 1 x 128 row tiles. By p.source: kGathered, of the
// rows gathered from x [p.values_rows, cols] (p.sources, p.factor); kActivated, of the
// activation of h = x [rows, 2 cols] or [rows, cols]; both as Fp8GroupColsParams says.
// Group sizes are clamped to the rows as common/grouped_gemm.h says.
void fp8_quantize_group_cols(const Fp8GroupColsParams& p);

// Fills p.dh, p.q and p.scales (host memory): the activation's backward and the 1 x 128
// row quantisation of d h (common/expert_activation.h). Expects non-negative sizes.
void fp8_activate_grad_quantize(const Fp8ActivateGradQuantizeParams& p);

}  // namespace moe_xla::cpu

#endif  // MOE_XLA_CPU_FP8_QUANTIZE_H_
