#!/usr/bin/env bash
# Quick start, command 2: installs what is missing, builds, runs every test.
# CI (.ci/run) runs exactly this. Extra arguments go to ctest.
#
# Phases: install (scripts/install-deps.sh), build (scripts/build.sh, against
# the environment's libtorch 2.x, unity batches with precompiled headers),
# then ctest, with beside it at the lowest priority the sanitizer build and
# the compile check (every unity batch, without the precompiled headers,
# against Debian's libtorch 1.13: scripts/check-libtorch-debian.sh), then
# the sanitizer tests (AddressSanitizer and UndefinedBehaviorSanitizer over
# the process world, checkpoints, hprun and hp-train: scripts/sanitize.sh).
# Each phase's time is printed at the end.
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

# The compile check and the sanitizer build need no test's result, and ctest
# leaves about a third of 2 cores idle (ranks waiting on each other, on
# rendezvous and on the timeouts the failure tests wait out: 133% CPU over
# its 13 minutes, measured with /usr/bin/time). So both run beside ctest,
# one after the other, at the lowest priority (nice 19: a test's process
# takes a core back from them at once), each into its own log, and get the
# whole machine once ctest is done. The sanitizer build comes first, as its
# tests follow ctest; the compile check goes on beside those. Each one's
# time is its own start to end, so the times below overlap.
background=$build/test-phases
rm -rf "$background"
mkdir -p "$background"
background_step() {  # background_step NAME COMMAND...: NAME.log, then NAME.status
  local name=$1 start rc=0
  shift
  start=$(date +%s)
  nice -n 19 "$@" >"$background/$name.log" 2>&1 || rc=$?
  echo "$rc $(( $(date +%s) - start ))" >"$background/$name.status"
}
wait_for() {  # wait_for NAME: its log once done, its time recorded; returns its status
  local name=$1 rc seconds
  while [ ! -f "$background/$name.status" ]; do
    if ! kill -0 "$background_pid" 2>/dev/null && [ ! -f "$background/$name.status" ]; then
      echo "test.sh: $name ended without a status (killed?)" >&2
      return 1
    fi
    sleep 2
  done
  read -r rc seconds <"$background/$name.status"
  cat "$background/$name.log"
  times+=("$name $seconds s, beside the tests")
  return "$rc"
}
sanitize=0
if [ "${HP_LIBTORCH:-venv}" = venv ] && [ "${HP_SANITIZE:-1}" != 0 ]; then sanitize=1; fi
set -m  # the steps get a process group of their own, which the trap below ends
(
  # The sanitizer phase (scripts/sanitize.sh): its own instrumented build of
  # the layers and tools below, and their tests. Against the environment's
  # libtorch only; HP_SANITIZE=0 leaves it out.
  if [ $sanitize = 1 ]; then background_step "sanitizer build" bash scripts/sanitize.sh --build-only; fi
  if [ "${HP_LIBTORCH:-venv}" != debian ]; then
    background_step "compile check (libtorch 1.13)" bash scripts/check-libtorch-debian.sh
  else
    background_step "compile check (libtorch 1.13)" python3 scripts/syntax-check.py "$build"
  fi
) &
background_pid=$!
set +m
# An interrupted run leaves no compile running behind it.
trap 'kill -- -$background_pid 2>/dev/null || true' EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# Multi-rank tests take both cores each (PROCESSORS 2), so -j2 only overlaps
# the small single-process ones with them. A failure still lets the
# sanitizer tests and the compile check run, so that one run reports all.
status=0
phase ctest ctest --test-dir "$build" --output-on-failure -j2 "$@" || status=$?
if [ $sanitize = 1 ]; then
  if wait_for "sanitizer build"; then
    phase "sanitizer tests" bash scripts/sanitize.sh --tests-only || status=$?
  else
    echo "test.sh: the sanitizer build failed (above); its tests did not run" >&2
    status=1
  fi
fi
wait_for "compile check (libtorch 1.13)" || status=$?
trap - EXIT
printf 'test.sh: %s\n' "${times[@]}"
exit $status
