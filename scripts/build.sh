#!/usr/bin/env bash
# Builds the FFI library with Bazel and copies it to moe_xla/_native/libmoe_xla.so.
# CUDA kernels are built when nvcc (CUDA_PATH or /usr/local/cuda) and nvidia-cutlass
# are present; MOE_XLA_CUDA=0 builds the CPU part only.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHON_BIN_PATH="${PYTHON_BIN_PATH:-$(command -v python3)}"
bazel build --repo_env=PYTHON_BIN_PATH="$PYTHON_BIN_PATH" --repo_env=MOE_XLA_CUDA="${MOE_XLA_CUDA:-auto}" \
  //moe_xla:libmoe_xla.so
mkdir -p moe_xla/_native
install -m 0644 bazel-bin/moe_xla/libmoe_xla.so moe_xla/_native/libmoe_xla.so
echo "built moe_xla/_native/libmoe_xla.so"
