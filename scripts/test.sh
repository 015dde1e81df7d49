#!/usr/bin/env bash
# Quick start, command 2: installs what is missing, builds, runs every test.
# CI (.ci/run) runs exactly this. Extra arguments go to ctest.
#
# Phases: install (scripts/install-deps.sh), build (scripts/build.sh, against
# the environment's libtorch 2.x, unity batches with precompiled headers),
# compile check (every source file on its own includes, without the
# precompiled headers, against Debian's libtorch 1.13:
# scripts/check-libtorch-debian.sh), ctest. Each phase's time is printed
# before ctest runs. The same per-file check against 2.x
# (python3 scripts/syntax-check.py build) is left out of this run: it
# repeats the 1.13 check for everything but libtorch's own header layout and
# costs ten minutes of the hour a CI run may take.
#
# HP_LIBTORCH=debian runs the whole suite against Debian's libtorch 1.13
# instead (build-debian/; its compile check is the same per-file check of
# that build's files).
set -euo pipefail
cd "$(dirname "$0")/.."

times=()
phase() {  # phase NAME COMMAND...: runs it, records its time
  local name=$1 start
  shift
  start=$(date +%s)
  "$@"
  times+=("$name $(( $(date +%s) - start )) s")
}

phase install bash scripts/install-deps.sh
phase build bash scripts/build.sh
source scripts/build-dir.sh
build=$(hp_build_dir)
if [ "${HP_LIBTORCH:-venv}" != debian ]; then
  phase "compile check (libtorch 1.13)" bash scripts/check-libtorch-debian.sh
else
  phase "compile check (libtorch 1.13)" python3 scripts/syntax-check.py "$build"
fi
printf 'test.sh: %s\n' "${times[@]}"
# Multi-rank tests take both cores each (PROCESSORS 2), so -j2 only overlaps
# the small single-process ones with them.
ctest --test-dir "$build" --output-on-failure -j2 "$@"
