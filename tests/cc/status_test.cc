// The error convention of common/status.h: codes, messages, context, and the CUDA macro's
// message (code, name, description, call, file:line), with stand-ins for the CUDA runtime.
#include "common/status.h"

#include <cstdio>
#include <string>

namespace {

int failures = 0;

void expect(bool ok, const std::string& what) {
  if (!ok) {
    std::printf("FAIL %s\n", what.c_str());
    ++failures;
  }
}

// Stand-ins for the three CUDA runtime names the macro expands to.
using cudaError_t = int;
constexpr cudaError_t cudaSuccess = 0;
int last_error_reads = 0;
cudaError_t cudaGetLastError() {
  ++last_error_reads;
  return cudaSuccess;
}
const char* cudaGetErrorName(cudaError_t) { return "cudaErrorIllegalAddress"; }
const char* cudaGetErrorString(cudaError_t) { return "an illegal memory access was encountered"; }

cudaError_t failing_call(int) { return 700; }

moe_xla::Status calls_cuda(cudaError_t result) {
  MOE_XLA_RETURN_IF_CUDA_ERROR(result == cudaSuccess ? cudaSuccess : failing_call(1));
  return moe_xla::Status();
}

moe_xla::Status forwards(moe_xla::Status inner, bool* reached_end) {
  MOE_XLA_RETURN_IF_ERROR(std::move(inner));
  *reached_end = true;
  return moe_xla::Status();
}

}  // namespace

int main() {
  using moe_xla::Status;
  using moe_xla::StatusCode;

  expect(Status().ok() && Status().code() == StatusCode::kOk && Status().message().empty(),
         "default Status is ok");
  const Status invalid = Status::InvalidArgument("route: bad top_k");
  expect(!invalid.ok() && invalid.code() == StatusCode::kInvalidArgument &&
             invalid.message() == "route: bad top_k" && invalid.cuda_error() == 0,
         "InvalidArgument keeps code and message");
  expect(Status::FailedPrecondition("x").code() == StatusCode::kFailedPrecondition,
         "FailedPrecondition code");
  expect(Status::Internal("x").code() == StatusCode::kInternal, "Internal code");
  expect(Status::Internal("inner").With("outer").message() == "outer: inner", "With prefixes");
  expect(Status().With("outer").ok(), "With keeps ok");

  expect(calls_cuda(cudaSuccess).ok() && last_error_reads == 0,
         "a successful CUDA call returns ok and leaves the last error alone");
  const Status cuda = calls_cuda(700);
  const std::string want_prefix =
      "CUDA error 700 (cudaErrorIllegalAddress: an illegal memory access was encountered) from "
      "result == cudaSuccess ? cudaSuccess : failing_call(1) at ";
  expect(cuda.code() == StatusCode::kInternal && cuda.cuda_error() == 700,
         "CUDA error: Internal with the cudaError_t value");
  expect(cuda.message().rfind(want_prefix, 0) == 0, "CUDA error message: " + cuda.message());
  expect(cuda.message().find("status_test.cc:") != std::string::npos,
         "CUDA error message names file:line: " + cuda.message());
  expect(last_error_reads == 1, "a failed CUDA call clears the last error");

  bool reached = false;
  const Status forwarded = forwards(Status::InvalidArgument("first"), &reached);
  expect(!reached && forwarded.message() == "first", "RETURN_IF_ERROR returns the error");
  expect(forwards(Status(), &reached).ok() && reached, "RETURN_IF_ERROR passes ok through");

  std::printf("%s: %d failure(s)\n", failures ? "FAILED" : "OK", failures);
  return failures ? 1 : 0;
}
