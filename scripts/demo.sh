#!/usr/bin/env bash
# The main job: installs and builds (scripts/setup.sh), then runs the demo on the
# default device (the GPU if JAX sees one, else the CPU).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
python3 -m moe_xla.demo "$@"
