// cuda/device_support.h: which kernels each compute capability runs, and the errors that
// name the capability and what is needed. Host only: runs without a GPU.
#include "cuda/device_support.h"

#include <cstdio>
#include <string>

namespace {

using moe_xla::cuda::device_support;
using moe_xla::cuda::device_support_error;
using moe_xla::cuda::DeviceSupport;

int failures = 0;

void expect(bool ok, const std::string& what) {
  if (!ok) {
    std::printf("FAIL %s\n", what.c_str());
    ++failures;
  }
}

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

}  // namespace

int main() {
  struct Case {
    int major, minor;
    DeviceSupport want;
  };
  const Case cases[] = {
      {7, 0, DeviceSupport::kNone},  {7, 5, DeviceSupport::kNone},   // Volta, Turing
      {8, 0, DeviceSupport::kSimt},  {8, 6, DeviceSupport::kSimt},   // A100, RTX 30xx
      {8, 9, DeviceSupport::kSimt},                                  // L40, RTX 40xx
      {9, 0, DeviceSupport::kFull},                                  // H100, H200
      {9, 1, DeviceSupport::kNone},                                  // no sm_90a SASS
      {10, 0, DeviceSupport::kSimt}, {10, 3, DeviceSupport::kSimt},  // B200, B300
      {11, 0, DeviceSupport::kSimt}, {12, 0, DeviceSupport::kSimt},  // by PTX JIT
      {0, 0, DeviceSupport::kNone},
  };
  for (const Case& c : cases) {
    const std::string cc = std::to_string(c.major) + "." + std::to_string(c.minor);
    const DeviceSupport got = device_support(c.major, c.minor);
    expect(got == c.want, "device_support(" + cc + ") = " + std::to_string(static_cast<int>(got)));
    for (DeviceSupport needed : {DeviceSupport::kSimt, DeviceSupport::kFull}) {
      const std::string error = device_support_error(c.major, c.minor, needed, "gmm");
      const bool has = static_cast<int>(c.want) >= static_cast<int>(needed);
      expect(has == error.empty(), cc + ": error iff unsupported: '" + error + "'");
      if (!error.empty()) {
        expect(contains(error, "gmm needs") && contains(error, "compute capability " + cc),
               cc + ": error names what and the capability: " + error);
      }
    }
  }
  const std::string simt = device_support_error(7, 5, DeviceSupport::kSimt, "route");
  expect(contains(simt, "MOE_XLA_IMPL=reference"), "kSimt error suggests the reference: " + simt);
  const std::string full = device_support_error(8, 0, DeviceSupport::kFull, "path cutlass_large");
  expect(contains(full, "9.0") && contains(full, "fallback"),
         "kFull error names 9.0 and the fallback: " + full);

  std::printf("%s: %d failure(s)\n", failures ? "FAILED" : "OK", failures);
  return failures ? 1 : 0;
}
