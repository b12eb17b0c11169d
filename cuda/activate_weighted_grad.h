// CUDA backward of the routing-weighted expert activation: d h and d omega of
// sum_r <omega[r] act(h[r]), g[r]> (ActivateWeightedGradParams in
// common/expert_activation.h). Framework-free: no XLA, no Python.
//
// One pass: reads h and g once, writes d h, d omega and b = omega * a (which may take g's
// place). Only enqueues work on `stream` (no
// host copy, no synchronisation, no global state: CUDA-graph safe). Runs on compute
// capability 8.x, 9.0 and 10.0 or later (cuda/device_support.h); an error elsewhere.
#ifndef MOE_XLA_CUDA_ACTIVATE_WEIGHTED_GRAD_H_
#define MOE_XLA_CUDA_ACTIVATE_WEIGHTED_GRAD_H_

#include <cuda_runtime_api.h>

#include "common/expert_activation.h"
#include "common/status.h"

namespace moe_xla {
namespace cuda {

// Fills p.dh, p.d_omega and p.weighted (device memory, as p.h, p.g and p.omega).
Status activate_weighted_grad(const ActivateWeightedGradParams& p, cudaStream_t stream);

}  // namespace cuda
}  // namespace moe_xla

#endif  // MOE_XLA_CUDA_ACTIVATE_WEIGHTED_GRAD_H_
