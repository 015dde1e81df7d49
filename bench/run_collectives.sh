#!/usr/bin/env bash
# Runs the collectives benchmark on 2 local ranks and plots it.
# Usage: bench/run_collectives.sh [out-dir]   (default: out/)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-out}
mkdir -p "$out"
build/tools/hprun/hprun -n 2 build/bench/bench_collectives --json "$out/collectives.json"
python=$(sed -n 's/^HP_PYTHON:FILEPATH=//p' build/CMakeCache.txt)
"${python:-python3}" bench/plot_collectives.py "$out/collectives.json" "$out/collectives.png"
echo "wrote $out/collectives.json and $out/collectives.png"
