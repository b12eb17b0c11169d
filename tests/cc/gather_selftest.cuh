// What the gather self-tests (gather_gemm_selftest.cu, gather_tgmm_selftest.cu) share:
// random group sizes and bf16 inputs, device copies, the output block between canaries
// (poisoned with NaN before a call, checked and read back after it), the replay of a
// call captured into a CUDA graph, the tally of checks and main(). Included by one
// translation unit per program.
#ifndef MOE_XLA_TESTS_CC_GATHER_SELFTEST_CUH_
#define MOE_XLA_TESTS_CC_GATHER_SELFTEST_CUH_

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "common/grouped_gemm.h"
#include "common/status.h"
#include "cuda/device.h"
#include "tools/cuda_check.h"

namespace gather_selftest {

// The output lies between two guards of kGuardBytes filled with kCanary.
constexpr uint32_t kCanary = 0xC0FFEE11u;
constexpr size_t kGuardBytes = 256;

// Sizes of `groups` groups drawn by multinomial(total) with equal probabilities, and
// `zeros` of them forced empty.
inline std::vector<int32_t> random_sizes(int64_t total, int64_t groups, int zeros, std::mt19937& rng) {
  std::vector<int32_t> sizes(static_cast<size_t>(groups), 0);
  std::uniform_int_distribution<int64_t> pick(0, groups - 1);
  std::vector<bool> empty(static_cast<size_t>(groups), false);
  for (int i = 0; i < zeros && i < groups - 1; ++i) empty[static_cast<size_t>(pick(rng))] = true;
  for (int64_t i = 0; i < total; ++i) {
    int64_t g = pick(rng);
    while (empty[static_cast<size_t>(g)]) g = (g + 1) % groups;
    ++sizes[static_cast<size_t>(g)];
  }
  return sizes;
}

template <class T>
T* device_copy(const std::vector<T>& host) {
  T* d = nullptr;
  CHECK_CUDA(cudaMalloc(&d, std::max<size_t>(host.size(), 1) * sizeof(T)));
  if (!host.empty()) CHECK_CUDA(cudaMemcpy(d, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
  return d;
}

inline std::vector<__nv_bfloat16> random_bf16(int64_t count, float scale, std::mt19937& rng) {
  std::uniform_real_distribution<float> u(-scale, scale);
  std::vector<__nv_bfloat16> v(static_cast<size_t>(count));
  for (auto& e : v) e = __float2bfloat16(u(rng));
  return v;
}

// Fills the guards of the block (guard | out_bytes | guard) with canaries and the output
// with NaN.
inline void poison(char* out_block, size_t out_bytes) {
  std::vector<uint32_t> guard(kGuardBytes / 4, kCanary);
  CHECK_CUDA(cudaMemcpy(out_block, guard.data(), kGuardBytes, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(out_block + kGuardBytes + out_bytes, guard.data(), kGuardBytes,
                        cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemset(out_block + kGuardBytes, 0xFF, out_bytes));  // NaN in bf16 and f32
}

// Copies the block back into `block`; false when a canary was overwritten.
inline bool read_block(const char* out_block, size_t out_bytes, std::vector<char>* block) {
  block->resize(out_bytes + 2 * kGuardBytes);
  CHECK_CUDA(cudaMemcpy(block->data(), out_block, block->size(), cudaMemcpyDeviceToHost));
  for (size_t i = 0; i < kGuardBytes; i += 4) {
    uint32_t before, after;
    std::memcpy(&before, block->data() + i, 4);
    std::memcpy(&after, block->data() + kGuardBytes + out_bytes + i, 4);
    if (before != kCanary || after != kCanary) return false;
  }
  return true;
}

// Element i of an output of dtype `dtype` (bf16 or f32) on the host, as float.
inline float out_element(const char* out, int64_t i, moe_xla::DType dtype) {
  float o;
  if (dtype == moe_xla::DType::kF32) {
    std::memcpy(&o, out + i * 4, 4);
  } else {
    __nv_bfloat16 b;
    std::memcpy(&b, out + i * 2, 2);
    o = __bfloat162float(b);
  }
  return o;
}

// Captures `call` (named `op`) on `stream` into a graph, runs `change` (which rewrites the
// inputs in device memory), replays the graph and returns check()'s message ("" when it
// passes), prefixed with "graph replay: "; or the captured call's error.
inline std::string replay_in_graph(cudaStream_t stream, const std::string& op,
                                   const std::function<moe_xla::Status()>& call,
                                   const std::function<void()>& change,
                                   const std::function<std::string()>& check) {
  std::string error;
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CHECK_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  const moe_xla::Status captured = call();
  CHECK_CUDA(cudaStreamEndCapture(stream, &graph));
  if (!captured.ok()) {
    error = "captured " + op + ": " + captured.message();
  } else {
    change();
    CHECK_CUDA(cudaGraphInstantiate(&exec, graph, 0));
    CHECK_CUDA(cudaGraphLaunch(exec, stream));
    CHECK_CUDA(cudaStreamSynchronize(stream));
    error = check();
    if (!error.empty()) error = "graph replay: " + error;
    CHECK_CUDA(cudaGraphExecDestroy(exec));
  }
  CHECK_CUDA(cudaGraphDestroy(graph));
  return error;
}

// The stream the checks run on and their tally; a program's runner derives from it.
struct RunnerBase {
  cudaStream_t stream = nullptr;
  int checks = 0, failures = 0;

  void fail(const std::string& what) {
    ++failures;
    std::printf("  FAIL %s\n", what.c_str());
  }
};

// main() of a self-test of `op`: exits 0 saying it skipped without a GPU of compute
// capability 9.0; otherwise runs Runner::run_case on every case of make_cases(rng) (rng
// seeded with `seed`) for bf16 and f32 output, then Runner::check_rejects, and prints a
// PASS/FAIL summary; the exit status is 1 if any check failed.
template <class Runner, class MakeCases>
int selftest_main(const char* program, const char* op, uint32_t seed, MakeCases make_cases) {
  exit_if_no_cuda_device(program);
  const moe_xla::Status device =
      moe_xla::cuda::require_device(moe_xla::cuda::DeviceSupport::kFull, op);
  if (!device.ok()) {
    std::printf("%s: SKIPPED, %s\n", program, device.message().c_str());
    return 0;
  }
  Runner runner;
  CHECK_CUDA(cudaStreamCreateWithFlags(&runner.stream, cudaStreamNonBlocking));
  std::mt19937 rng(seed);
  for (const auto& cs : make_cases(rng)) {
    for (moe_xla::DType out : {moe_xla::DType::kBF16, moe_xla::DType::kF32}) runner.run_case(cs, out, rng);
  }
  runner.check_rejects();
  CHECK_CUDA(cudaStreamDestroy(runner.stream));
  std::printf("%s: %d of %d checks failed\n", runner.failures ? "FAIL" : "PASS", runner.failures,
              runner.checks);
  return runner.failures ? 1 : 0;
}

}  // namespace gather_selftest

#endif  // MOE_XLA_TESTS_CC_GATHER_SELFTEST_CUH_
