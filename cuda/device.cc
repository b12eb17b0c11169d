#include "cuda/device.h"

#include <cuda_runtime_api.h>

#include "common/status.h"
#include "cuda/device_support.h"

namespace moe_xla {
namespace cuda {

Status current_device_support(DeviceSupport* support, int* major, int* minor) {
  int device = 0;
  MOE_XLA_RETURN_IF_CUDA_ERROR(cudaGetDevice(&device));
  MOE_XLA_RETURN_IF_CUDA_ERROR(
      cudaDeviceGetAttribute(major, cudaDevAttrComputeCapabilityMajor, device));
  MOE_XLA_RETURN_IF_CUDA_ERROR(
      cudaDeviceGetAttribute(minor, cudaDevAttrComputeCapabilityMinor, device));
  *support = device_support(*major, *minor);
  return Status();
}

Status current_device_sm_count(int* sm_count) {
  int device = 0;
  MOE_XLA_RETURN_IF_CUDA_ERROR(cudaGetDevice(&device));
  MOE_XLA_RETURN_IF_CUDA_ERROR(
      cudaDeviceGetAttribute(sm_count, cudaDevAttrMultiProcessorCount, device));
  return Status();
}

Status require_device(DeviceSupport needed, const char* what) {
  DeviceSupport support;
  int major = 0, minor = 0;
  MOE_XLA_RETURN_IF_ERROR(current_device_support(&support, &major, &minor));
  if (static_cast<int>(support) >= static_cast<int>(needed)) return Status();
  return Status::FailedPrecondition(device_support_error(major, minor, needed, what));
}

}  // namespace cuda
}  // namespace moe_xla
