// Error handling of the GPU programs (the self-tests in tests/cc/ and the benchmark in
// tools/), which stop at the first unexpected CUDA error. Library code returns a Status
// instead (common/status.h).
#ifndef MOE_XLA_TOOLS_CUDA_CHECK_H_
#define MOE_XLA_TOOLS_CUDA_CHECK_H_

#include <cuda_runtime_api.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "common/status.h"

// Prints the failed call with its CUDA error and file:line, and exits with status 2.
#define CHECK_CUDA(expr)                                                             \
  do {                                                                               \
    cudaError_t err_ = (expr);                                                       \
    if (err_ != cudaSuccess) {                                                       \
      std::fprintf(stderr, "CUDA error %s at %s:%d: %s\n", cudaGetErrorString(err_), \
                   __FILE__, __LINE__, #expr);                                       \
      std::exit(2);                                                                  \
    }                                                                                \
  } while (0)

// The message of `status`, "" when it is ok: programs keep the first error of a series of
// calls as a string.
inline std::string error_message(const moe_xla::Status& status) {
  return status.ok() ? std::string() : status.message();
}

// Exits with status 0 after saying so when no CUDA device is visible: `bazel test //...`
// builds and runs the GPU tests on machines without a GPU, where they pass as skipped.
inline void exit_if_no_cuda_device(const char* program) {
  int devices = 0;
  const cudaError_t err = cudaGetDeviceCount(&devices);
  if (err == cudaSuccess && devices > 0) return;
  std::printf("%s: SKIPPED, no CUDA device (%s)\n", program,
              err == cudaSuccess ? "0 devices" : cudaGetErrorString(err));
  std::exit(0);
}

#endif  // MOE_XLA_TOOLS_CUDA_CHECK_H_
