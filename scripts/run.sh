#!/usr/bin/env bash
# Quick start, command 1: installs what is missing, builds, and runs the main
# job on its embedded default: 4 local ranks on loopback.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
bash scripts/build.sh
exec build/tools/hprun/hprun -n 4 build/examples/dtensor_demo "$@"
