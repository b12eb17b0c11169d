// GPU check of fp8::fast_quotient (common/fp8_blockwise.h), the quantisation kernels'
// division-free quotient: v = fast_quotient(x, s, fl(1 / s)) must be fl(x / s) (the
// correctly rounded quotient, __fdiv_rn) bitwise.
//
// With x and s normal and no intermediate leaving float32's normal range (what the
// header's conditions s >= kFastScaleMin and |x / s| >= 2^-23 ensure, its comment says
// why), every step scales exactly with the exponents of x and s, so the result depends on
// their significands only. Every pair of significands is one pair (x, s) in [1, 2)^2:
// x < s gives the quotients in (1/2, 1), x >= s those in [1, 2). With --exhaustive this
// program checks all 2^46 of them (about a minute on an H200); by default it checks every
// x against the scale significands nearest 1 and 2 (where the first product is furthest
// from x / s) and a fixed sample of others, a few seconds. Negative x: every step is
// odd in x. Without a GPU it exits 0 saying it skipped. Exit status 1 on any mismatch.
// Usage: fast_quotient_selftest [--exhaustive]
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "common/fp8_blockwise.h"
#include "tools/cuda_check.h"

namespace {

constexpr uint32_t kSignificands = 1u << 23;
constexpr int kThreads = 256;
constexpr int kMaxReported = 8;

struct Mismatches {
  unsigned long long count;
  uint32_t x[kMaxReported], s[kMaxReported];
};

// One CTA per scale significand in `scales`; its threads stride through every x.
__global__ void sweep(const uint32_t* __restrict__ scales, Mismatches* out) {
  const float s = moe_xla::fp8::bits_float(0x3f800000u | scales[blockIdx.x]);
  const float inverse = moe_xla::fp8::tile_inverse(s);
  unsigned found = 0;
  uint32_t first = 0;
  for (uint32_t m = threadIdx.x; m < kSignificands; m += kThreads) {
    const float x = moe_xla::fp8::bits_float(0x3f800000u | m);
    const float v = moe_xla::fp8::fast_quotient(x, s, inverse);
    if (__float_as_uint(v) != __float_as_uint(__fdiv_rn(x, s))) {
      if (found++ == 0) first = m;
    }
  }
  if (found > 0) {
    const unsigned long long slot = atomicAdd(&out->count, found);
    if (slot < kMaxReported) out->x[slot] = first, out->s[slot] = scales[blockIdx.x];
  }
}

}  // namespace

int main(int argc, char** argv) {
  exit_if_no_cuda_device("fast_quotient_selftest");
  const bool exhaustive = argc > 1 && std::strcmp(argv[1], "--exhaustive") == 0;
  std::vector<uint32_t> scales;
  if (exhaustive) {
    for (uint32_t m = 0; m < kSignificands; ++m) scales.push_back(m);
  } else {
    for (uint32_t m = 0; m < 256; ++m) scales.push_back(m), scales.push_back(kSignificands - 1 - m);
    std::mt19937 random(20261203);
    for (int i = 0; i < 3584; ++i) scales.push_back(random() % kSignificands);
  }
  uint32_t* d_scales = nullptr;
  Mismatches* d_out = nullptr;
  CHECK_CUDA(cudaMalloc(&d_scales, scales.size() * sizeof(uint32_t)));
  CHECK_CUDA(cudaMalloc(&d_out, sizeof(Mismatches)));
  CHECK_CUDA(cudaMemcpy(d_scales, scales.data(), scales.size() * sizeof(uint32_t), cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemset(d_out, 0, sizeof(Mismatches)));
  cudaEvent_t start, stop;
  CHECK_CUDA(cudaEventCreate(&start));
  CHECK_CUDA(cudaEventCreate(&stop));
  CHECK_CUDA(cudaEventRecord(start));
  constexpr size_t kLaunch = 1u << 16;  // CTAs per launch
  for (size_t first = 0; first < scales.size(); first += kLaunch) {
    const size_t n = scales.size() - first < kLaunch ? scales.size() - first : kLaunch;
    sweep<<<static_cast<unsigned>(n), kThreads>>>(d_scales + first, d_out);
    CHECK_CUDA(cudaGetLastError());
  }
  CHECK_CUDA(cudaEventRecord(stop));
  CHECK_CUDA(cudaEventSynchronize(stop));
  float ms = 0.0f;
  CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
  Mismatches out{};
  CHECK_CUDA(cudaMemcpy(&out, d_out, sizeof out, cudaMemcpyDeviceToHost));
  const double pairs = static_cast<double>(scales.size()) * kSignificands;
  for (unsigned long long i = 0; i < out.count && i < kMaxReported; ++i) {
    std::printf("FAIL x = 0x%06x, s = 0x%06x (significands): fast_quotient != x / s\n", out.x[i], out.s[i]);
  }
  std::printf("%s: %s, %zu scale significands x %u, %.3g pairs in %.1f s: %llu mismatches\n",
              out.count ? "FAIL" : "PASS", exhaustive ? "exhaustive" : "sampled", scales.size(), kSignificands,
              pairs, ms / 1000.0, out.count);
  return out.count ? 1 : 0;
}
