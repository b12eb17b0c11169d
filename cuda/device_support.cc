#include "cuda/device_support.h"

#include <string>

namespace moe_xla {
namespace cuda {

DeviceSupport device_support(int major, int minor) {
  if (major == 9) return minor == 0 ? DeviceSupport::kFull : DeviceSupport::kNone;
  if (major == 8 || major >= 10) return DeviceSupport::kSimt;
  return DeviceSupport::kNone;
}

std::string device_support_error(int major, int minor, DeviceSupport needed, const char* what) {
  if (static_cast<int>(device_support(major, minor)) >= static_cast<int>(needed)) return "";
  const std::string device =
      "the current GPU has compute capability " + std::to_string(major) + "." + std::to_string(minor);
  if (needed == DeviceSupport::kFull) {
    return std::string(what) + " needs compute capability 9.0 (Hopper, sm_90a); " + device +
           ". Use the auto or fallback path, which runs the SIMT grouped GEMM there";
  }
  return std::string(what) + " needs compute capability 8.x, 9.0 or 10.0 and later " +
         "(moe_xla's CUDA kernels are built for sm_80, sm_90a and sm_100, with compute_100 " +
         "PTX); " + device + ". Set MOE_XLA_IMPL=reference to run the pure-JAX reference " +
         "implementation instead";
}

}  // namespace cuda
}  // namespace moe_xla
