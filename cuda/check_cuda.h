// CHECK_CUDA for the GPU self-test and benchmark programs (not for library code, which
// returns errors): prints the failed call and exits with status 2.
#ifndef MOE_XLA_CUDA_CHECK_CUDA_H_
#define MOE_XLA_CUDA_CHECK_CUDA_H_

#include <cuda_runtime_api.h>

#include <cstdio>
#include <cstdlib>

#define CHECK_CUDA(expr)                                                             \
  do {                                                                               \
    cudaError_t err_ = (expr);                                                       \
    if (err_ != cudaSuccess) {                                                       \
      std::fprintf(stderr, "CUDA error %s at %s:%d: %s\n", cudaGetErrorString(err_), \
                   __FILE__, __LINE__, #expr);                                       \
      std::exit(2);                                                                  \
    }                                                                                \
  } while (0)

#endif  // MOE_XLA_CUDA_CHECK_CUDA_H_
