#!/usr/bin/env bash
# Quick start, command 2: installs what is missing, builds, runs every test.
# CI (.ci/run) runs exactly this. Extra arguments go to ctest.
#
# Phases: install (scripts/install-deps.sh), build (scripts/build.sh, against
# the environment's libtorch 2.x, unity batches with precompiled headers),
# compile check (every unity batch, without the precompiled headers, against
# Debian's libtorch 1.13: scripts/check-libtorch-debian.sh), ctest,
# sanitizers (AddressSanitizer and UndefinedBehaviorSanitizer over the
# process world, checkpoints, hprun and hp-train: scripts/sanitize.sh). Each
# phase's time is printed at the end.
#
# Left out for time (the whole run must stay within the hour CI allows):
# the compile check of every file on its own includes
# (scripts/check-libtorch-debian.sh --per-file: 2.8 times the batches'
# cost, 11 minutes that pay for the sanitizer phase; docs/design.md,
# "Sanitizers"), and the same per-file check against 2.x (python3
# scripts/syntax-check.py build), which repeats the 1.13 one for everything
# but libtorch's own header layout.
#
# HP_LIBTORCH=debian runs the whole suite against Debian's libtorch 1.13
# instead (build-debian/; its compile check is the same per-file check of
# that build's files).
set -euo pipefail
cd "$(dirname "$0")/.."

times=()
phase() {  # phase NAME COMMAND...: runs it, records its time, returns its status
  local name=$1 start rc=0
  shift
  start=$(date +%s)
  "$@" || rc=$?
  times+=("$name $(( $(date +%s) - start )) s")
  return $rc
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
# Multi-rank tests take both cores each (PROCESSORS 2), so -j2 only overlaps
# the small single-process ones with them. A failure still lets the
# sanitizer phase run, so that one run reports both.
status=0
phase ctest ctest --test-dir "$build" --output-on-failure -j2 "$@" || status=$?
# The sanitizer phase (scripts/sanitize.sh): its own instrumented build of
# the layers and tools below, and their tests. Against the environment's
# libtorch only; HP_SANITIZE=0 leaves it out.
if [ "${HP_LIBTORCH:-venv}" = venv ] && [ "${HP_SANITIZE:-1}" != 0 ]; then
  phase sanitizers bash scripts/sanitize.sh || status=$?
fi
printf 'test.sh: %s\n' "${times[@]}"
exit $status
