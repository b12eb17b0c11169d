// The one error convention of the kernels (cpu/, cuda/) and the FFI handlers (ffi/).
//
// A function that can fail returns a Status: ok, or a code that says what kind of
// failure it is and a message that says what failed. A failed CUDA runtime call becomes
// a Status that carries the cudaError_t value, its name and description, the call's text
// and its file:line (MOE_XLA_RETURN_IF_CUDA_ERROR). The FFI handlers turn a Status into
// the ffi::Error they return (ffi/status.h); nothing is thrown across the FFI boundary.
//
// Framework-free and CUDA-free: the CUDA macro names cudaError_t, cudaSuccess and the
// cudaGet* functions only where it is expanded, in files that include the CUDA runtime.
#ifndef MOE_XLA_COMMON_STATUS_H_
#define MOE_XLA_COMMON_STATUS_H_

#include <string>
#include <utility>

namespace moe_xla {

enum class StatusCode : int {
  kOk = 0,
  kInvalidArgument = 1,     // the caller passed something the function does not accept
  kFailedPrecondition = 2,  // the call is valid but not here (e.g. a GPU the kernels lack)
  kInternal = 3,            // a CUDA or library call failed
};

class [[nodiscard]] Status {
 public:
  Status() = default;  // ok

  static Status InvalidArgument(std::string message) {
    return Status(StatusCode::kInvalidArgument, std::move(message));
  }
  static Status FailedPrecondition(std::string message) {
    return Status(StatusCode::kFailedPrecondition, std::move(message));
  }
  static Status Internal(std::string message) {
    return Status(StatusCode::kInternal, std::move(message));
  }

  // CUDA runtime call `call` returned `error` (a cudaError_t other than cudaSuccess, with
  // its cudaGetErrorName and cudaGetErrorString) at file:line.
  static Status Cuda(int error, const char* name, const char* description, const char* call,
                     const char* file, int line) {
    Status s(StatusCode::kInternal, "CUDA error " + std::to_string(error) + " (" + name + ": " +
                                        description + ") from " + call + " at " + file + ":" +
                                        std::to_string(line));
    s.cuda_error_ = error;
    return s;
  }

  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }
  // The cudaError_t value of an error raised by a CUDA call, 0 (cudaSuccess) otherwise.
  int cuda_error() const { return cuda_error_; }

  // This error with "`context`: " before its message (ok stays ok).
  Status With(const std::string& context) && {
    if (!ok()) message_ = context + ": " + message_;
    return std::move(*this);
  }

 private:
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  StatusCode code_ = StatusCode::kOk;
  std::string message_;
  int cuda_error_ = 0;
};

}  // namespace moe_xla

// Returns the Status of `expr` from the enclosing function unless it is ok.
#define MOE_XLA_RETURN_IF_ERROR(expr)                   \
  do {                                                  \
    ::moe_xla::Status moe_xla_status_ = (expr);         \
    if (!moe_xla_status_.ok()) return moe_xla_status_;  \
  } while (0)

// Returns a Status naming the CUDA error, the call and its file:line from the enclosing
// function unless the CUDA runtime call `expr` returns cudaSuccess. The runtime's
// last-error slot is cleared, so a later check does not report this error again.
#define MOE_XLA_RETURN_IF_CUDA_ERROR(expr)                                                  \
  do {                                                                                      \
    const cudaError_t moe_xla_cuda_error_ = (expr);                                         \
    if (moe_xla_cuda_error_ != cudaSuccess) {                                               \
      (void)cudaGetLastError();                                                             \
      return ::moe_xla::Status::Cuda(static_cast<int>(moe_xla_cuda_error_),                 \
                                     cudaGetErrorName(moe_xla_cuda_error_),                 \
                                     cudaGetErrorString(moe_xla_cuda_error_), #expr,        \
                                     __FILE__, __LINE__);                                   \
    }                                                                                       \
  } while (0)

#endif  // MOE_XLA_COMMON_STATUS_H_
