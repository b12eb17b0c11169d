// Which of moe_xla's CUDA kernels a GPU can run, from its compute capability and the
// architectures bazel/cuda.bzl compiles for. Pure host code (no CUDA headers).
//
//   kFull (9.0, Hopper): every kernel, the CUTLASS grouped GEMMs included. Those use
//     wgmma, setmaxnreg and TMA multicast, so they exist as sm_90a SASS only (their
//     compute_90a PTX cannot be JIT-compiled for any other GPU).
//   kSimt (8.x from sm_80 SASS; 10.0 from sm_100 SASS; later GPUs by JIT from the
//     compute_100 PTX): route, permute, unpermute and the SIMT grouped GEMM, which need
//     no Hopper instruction. Correct, and slower than the CUTLASS paths.
//   kNone (below 8.0, and 9.x other than 9.0): no kernel image for the device.
#ifndef MOE_XLA_CUDA_DEVICE_SUPPORT_H_
#define MOE_XLA_CUDA_DEVICE_SUPPORT_H_

#include <string>

namespace moe_xla {
namespace cuda {

enum class DeviceSupport : int { kNone = 0, kSimt = 1, kFull = 2 };

DeviceSupport device_support(int major, int minor);

// "" when a device of compute capability major.minor has at least `needed`; else the
// message of the error: what `what` needs, the device's capability, and what to do.
std::string device_support_error(int major, int minor, DeviceSupport needed, const char* what);

}  // namespace cuda
}  // namespace moe_xla

#endif  // MOE_XLA_CUDA_DEVICE_SUPPORT_H_
