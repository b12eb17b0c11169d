// Device workspace of the CUDA handlers.
//
// Workspace is an extra uint8 result of the custom call, sized at lowering time from
// the exported *WorkspaceBytes functions below, so XLA allocates it like any buffer and
// its address stays valid across CUDA-graph (command buffer) replays. (Memory from the
// FFI scratch allocator is released when the handler returns, while a recorded graph
// keeps using the address.)
#ifndef MOE_XLA_FFI_WORKSPACE_H_
#define MOE_XLA_FFI_WORKSPACE_H_

#include <cstddef>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace moe_xla::ffi_args {

namespace ffi = xla::ffi;

// The most SMs a device may have: the exported *WorkspaceBytes functions size the
// workspace for it at lowering time, before the device is known.
constexpr int kMaxSmCount = 1024;

// An error when the device has more SMs than the workspace was sized for.
inline ffi::Error check_sm_count(int sm_count, const char* what) {
  if (sm_count <= kMaxSmCount) return ffi::Error::Success();
  return ffi::Error::Internal(std::string("moe_xla ") + what + ": the workspace is sized for at most " +
                              std::to_string(kMaxSmCount) + " SMs, the device has " + std::to_string(sm_count));
}

// The workspace result as a pointer, after checking it holds at least `needed` bytes.
inline ffi::ErrorOr<void*> workspace(ffi::AnyBuffer buffer, size_t needed, const char* what) {
  if (buffer.size_bytes() < needed) {
    return ffi::Unexpected<ffi::Error>(ffi::Error::InvalidArgument(
        std::string(what) + ": expected a workspace of at least " + std::to_string(needed) +
        " bytes, got " + std::to_string(buffer.size_bytes())));
  }
  return buffer.untyped_data();
}

}  // namespace moe_xla::ffi_args

#endif  // MOE_XLA_FFI_WORKSPACE_H_
