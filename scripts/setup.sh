#!/usr/bin/env bash
# Installs what building and testing moe_xla needs on a fresh Debian machine
# (Bazel from Debian's bazel-bootstrap, the Python packages), then builds the library.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v bazel >/dev/null; then
  sudo=""; [ "$(id -u)" = 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq bazel-bootstrap >/dev/null
fi
python3 -m pip install -q -r requirements-dev.txt
scripts/build.sh
