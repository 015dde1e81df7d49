#!/usr/bin/env bash
# Quick start, command 2: installs what is missing, builds, runs every test.
# CI (.ci/run) runs exactly this.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
bash scripts/build.sh
# Every source file must still compile against libtorch 2.x (headers only).
bash scripts/check-libtorch2.sh
# Multi-rank tests take both cores each (PROCESSORS 2), so -j2 only overlaps
# the small single-process ones with them.
ctest --test-dir build --output-on-failure -j2 "$@"
