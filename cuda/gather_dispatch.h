// Host pieces shared by the dispatchers of the gather products (gather_gemm.cu,
// gather_tgmm.cu): the table of their compiled kernels, one per output dtype, and the
// workspace's alignment and size check.
#ifndef MOE_XLA_CUDA_GATHER_DISPATCH_H_
#define MOE_XLA_CUDA_GATHER_DISPATCH_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "common/grouped_gemm.h"
#include "common/status.h"

namespace moe_xla {
namespace cuda {
namespace detail {

// One compiled kernel of a dispatcher: its output dtype and its launcher.
template <class Launch>
struct OutDtypeInstance {
  DType out_dtype;
  Status (*run)(const Launch& launch);
};

// The entry of `table` for out_dtype, or null.
template <class Launch, size_t N>
const OutDtypeInstance<Launch>* find_instance(const OutDtypeInstance<Launch> (&table)[N],
                                              DType out_dtype) {
  for (const OutDtypeInstance<Launch>& inst : table) {
    if (inst.out_dtype == out_dtype) return &inst;
  }
  return nullptr;
}

// The workspace's parts start at multiples of kAlign bytes from its first aligned byte.
constexpr size_t kAlign = 256;
inline size_t align_up(size_t x) { return (x + kAlign - 1) / kAlign * kAlign; }
inline char* aligned_base(void* workspace) {
  const uintptr_t raw = reinterpret_cast<uintptr_t>(workspace);
  return reinterpret_cast<char*>((raw + kAlign - 1) & ~static_cast<uintptr_t>(kAlign - 1));
}

// Ok, or an InvalidArgument saying how many bytes `op` was given and needs when the
// workspace is null or smaller than `needed`.
inline Status check_workspace(const char* op, const void* workspace, size_t workspace_bytes,
                              size_t needed) {
  if (workspace == nullptr || workspace_bytes < needed) {
    return Status::InvalidArgument(std::string(op) + ": workspace of " +
                                   std::to_string(workspace == nullptr ? 0 : workspace_bytes) +
                                   " bytes, it needs " + std::to_string(needed));
  }
  return Status();
}

}  // namespace detail
}  // namespace cuda
}  // namespace moe_xla

#endif  // MOE_XLA_CUDA_GATHER_DISPATCH_H_
