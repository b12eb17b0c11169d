#!/usr/bin/env bash
# Builds what a GPU visit runs on a machine without Bazel, and copies it into .gpu_bin/
# (or $GPU_BIN): the GPU self-tests of tests/cc (grouped_gemm_selftest, routing_selftest,
# fast_quotient_selftest, gather_gemm_selftest, gather_tgmm_selftest), the benchmarks (grouped_gemm_bench,
# gather_gemm_bench, gather_tgmm_bench) and the FFI library (libmoe_xla.so).
# The binaries link the CUDA runtime statically. On the GPU machine, from the repo root:
#   benchmarks/gpu_check.sh selftest sanitize
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHON_BIN_PATH="${PYTHON_BIN_PATH:-$(command -v python3)}"
out="${GPU_BIN:-.gpu_bin}"
bazel build --repo_env=PYTHON_BIN_PATH="$PYTHON_BIN_PATH" \
  //tests/cc:grouped_gemm_selftest //tests/cc:routing_selftest //tests/cc:gather_gemm_selftest //tests/cc:fast_quotient_selftest \
  //tests/cc:gather_tgmm_selftest //tools:grouped_gemm_bench //tools:gather_gemm_bench //tools:gather_tgmm_bench \
  //moe_xla:libmoe_xla.so
mkdir -p "$out"
install -m 0755 bazel-bin/tests/cc/grouped_gemm_selftest bazel-bin/tests/cc/routing_selftest bazel-bin/tests/cc/fast_quotient_selftest \
  bazel-bin/tests/cc/gather_gemm_selftest bazel-bin/tests/cc/gather_tgmm_selftest \
  bazel-bin/tools/grouped_gemm_bench bazel-bin/tools/gather_gemm_bench bazel-bin/tools/gather_tgmm_bench "$out/"
install -m 0644 bazel-bin/moe_xla/libmoe_xla.so "$out/"
echo "built into $out/: $(ls "$out" | tr '\n' ' ')"
