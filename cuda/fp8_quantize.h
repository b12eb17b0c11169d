// CUDA FP8 blockwise quantisation in tiles of tile_rows x 128 (contract in
// common/fp8_blockwise.h), alone or fused with the expert activation or an expansion of rows.
// Framework-free: no XLA, no Python.
//
// Only enqueues work on `stream` (no host copy, no synchronisation, no global state:
// CUDA-graph safe) and is bitwise deterministic. Reads x once. Runs on compute capability
// 8.x, 9.0 and 10.0 or later (cuda/device_support.h); returns an error elsewhere.
#ifndef MOE_XLA_CUDA_FP8_QUANTIZE_H_
#define MOE_XLA_CUDA_FP8_QUANTIZE_H_

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "common/expert_activation.h"
#include "common/fp8_blockwise.h"
#include "common/status.h"

namespace moe_xla {
namespace cuda {

// Fills p.q and p.scales (device memory) from p.x, and p.q_t when given (blocks).
Status fp8_quantize(const Fp8QuantizeParams& p, cudaStream_t stream);

// Fills p.a, p.q and p.scales (device memory): the expert activation of p.h and its
// 1 x 128 row quantisation in one pass (common/expert_activation.h).
Status fp8_activate_quantize(const Fp8ActivateQuantizeParams& p, cudaStream_t stream);

// Fills p.out, p.q and p.scales (device memory, p.slots and p.factor too): the token rows
// expanded into the rows p.slots names, scaled (p.factor null: every factor 1), and their
// 1 x 128 row quantisation, each token row read once (Fp8ExpandQuantizeParams in
// common/fp8_blockwise.h). workspace (device memory, fp8_expand_workspace_bytes) holds the
// row owners. No access outside the buffers, whatever p.slots holds.
Status fp8_expand_quantize(const Fp8ExpandQuantizeParams& p, void* workspace, cudaStream_t stream);
size_t fp8_expand_workspace_bytes(int64_t rows, int64_t pairs);
size_t fp8_expand_workspace_bytes(const Fp8ExpandQuantizeParams& p);

// Fills p.q_t and p.scales (device memory): x quantised in 128 x 1 column tiles that
// restart at every group boundary, transposed (common/fp8_blockwise.h,
// Fp8GroupColsParams), and with p.q given p.q and p.row_scales: x's 1 x 128 row tiles,
// from the same read. Group sizes stay on the device.
Status fp8_quantize_group_cols(const Fp8GroupColsParams& p, cudaStream_t stream);

// Fills p.dh, p.q and p.scales (device memory): the activation's backward from p.h and
// p.da and the 1 x 128 row quantisation of d h in one pass (common/expert_activation.h).
Status fp8_activate_grad_quantize(const Fp8ActivateGradQuantizeParams& p, cudaStream_t stream);

}  // namespace cuda
}  // namespace moe_xla

#endif  // MOE_XLA_CUDA_FP8_QUANTIZE_H_
