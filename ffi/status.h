// The FFI boundary of the error convention (common/status.h): a kernel's Status becomes
// the ffi::Error the handler returns, its message prefixed with "moe_xla <op>: ".
#ifndef MOE_XLA_FFI_STATUS_H_
#define MOE_XLA_FFI_STATUS_H_

#include <string>

#include "common/status.h"
#include "xla/ffi/api/ffi.h"

namespace moe_xla::ffi_args {

namespace ffi = xla::ffi;

inline ffi::Error to_error(const Status& status, const char* op) {
  if (status.ok()) return ffi::Error::Success();
  std::string message = std::string("moe_xla ") + op + ": " + status.message();
  switch (status.code()) {
    case StatusCode::kInvalidArgument:
      return ffi::Error::InvalidArgument(std::move(message));
    case StatusCode::kFailedPrecondition:
      return ffi::Error(ffi::ErrorCode::kFailedPrecondition, std::move(message));
    default:
      return ffi::Error::Internal(std::move(message));
  }
}

}  // namespace moe_xla::ffi_args

#endif  // MOE_XLA_FFI_STATUS_H_
