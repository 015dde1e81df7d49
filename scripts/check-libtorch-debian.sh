#!/usr/bin/env bash
# Compile-only check of every project source file against Debian's libtorch
# 1.13 (libtorch-dev), so that support for it cannot rot while the suite
# builds and runs against libtorch 2.x.
#
# The flags are CMake's own for a build against Debian's libtorch: the
# project is configured (not built) into build-debian-check/, and each entry
# of its compile_commands.json runs with -fsyntax-only instead of -c and
# without the precompiled header (scripts/syntax-check.py):
#   default     each unity batch as the build compiles it, one compile a batch
#               (what the CI run, scripts/test.sh, does: a third of the cost)
#   --per-file  each file of a batch on its own, so that every file compiles
#               on its own includes (a missing #include that the precompiled
#               header or an earlier file of the batch would supply fails
#               here); for a developer's check of the files they changed
#
# Usage: scripts/check-libtorch-debian.sh [-j N] [--per-file] [PATH...]
#   (default: -j nproc, every batch; PATH: files or directories, with the
#   default mode every batch holding one of them)
# Environment: HP_CHECK_DIR  the configure directory (default: build-debian-check)
set -euo pipefail
cd "$(dirname "$0")/.."

jobs=$(nproc)
mode=--batches
while [ $# -gt 0 ]; do
  case "$1" in
    -j) jobs=$2; shift 2 ;;
    --per-file) mode=; shift ;;
    *) break ;;
  esac
done
dir=${HP_CHECK_DIR:-build-debian-check}

version_h=/usr/include/torch/csrc/api/include/torch/version.h
[ -f "$version_h" ] ||
  { echo "check-libtorch-debian: Debian's libtorch-dev is not installed (scripts/install-deps.sh)" >&2; exit 1; }
version=$(awk '/#define TORCH_VERSION_(MAJOR|MINOR|PATCH) /{v = v (v ? "." : "") $3} END {print v}' "$version_h")

mkdir -p "$dir"
cmake -S . -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH=/usr \
      -DHP_PYTHON=/usr/bin/python3 -DCMAKE_EXPORT_COMPILE_COMMANDS=ON >"$dir/configure.log" 2>&1 ||
  { cat "$dir/configure.log" >&2; echo "check-libtorch-debian: configuring against libtorch $version failed" >&2; exit 1; }

if [ -n "$mode" ]; then
  echo "check-libtorch-debian: every unity batch against Debian's libtorch $version"
else
  echo "check-libtorch-debian: every source file on its own against Debian's libtorch $version"
fi
python3 scripts/syntax-check.py -j "$jobs" $mode "$dir" "$@"
