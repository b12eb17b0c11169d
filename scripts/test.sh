#!/usr/bin/env bash
# The test command: installs and builds (scripts/setup.sh), then runs the C++ kernel
# tests (bazel test //...) and the pytest suite. GPU tests skip where no GPU is present.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
bazel test --repo_env=PYTHON_BIN_PATH="$(command -v python3)" //...
python3 -m pytest tests "$@"
