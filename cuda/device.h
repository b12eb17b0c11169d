// The current CUDA device checked against what a kernel needs (cuda/device_support.h).
#ifndef MOE_XLA_CUDA_DEVICE_H_
#define MOE_XLA_CUDA_DEVICE_H_

#include "common/status.h"
#include "cuda/device_support.h"

namespace moe_xla {
namespace cuda {

// What the current device (cudaGetDevice) supports, in *support; its compute capability
// in *major and *minor. Queries device attributes only: no synchronisation, nothing cached.
Status current_device_support(DeviceSupport* support, int* major, int* minor);

// The number of SMs of the current device (cudaDevAttrMultiProcessorCount), in *sm_count.
Status current_device_sm_count(int* sm_count);

// Ok when the current device supports at least `needed`; else a FailedPrecondition error
// that names what `what` needs and the device's compute capability.
Status require_device(DeviceSupport needed, const char* what);

}  // namespace cuda
}  // namespace moe_xla

#endif  // MOE_XLA_CUDA_DEVICE_H_
