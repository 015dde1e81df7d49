#!/usr/bin/env bash
# AddressSanitizer and UndefinedBehaviorSanitizer over the process world,
# the checkpoints, the launcher and hp-train: builds the libraries, hprun,
# hp-train and those tests instrumented (build directory build-asan/), runs
# them, and fails if a test fails or any process of any test (hprun's ranks
# and the subprocesses tests start included) reported an error.
# scripts/test.sh runs it as its "sanitizers" phase, in two steps: the build
# beside ctest, the tests after it. Extra arguments go to ctest.
#
# Usage: scripts/sanitize.sh [--build-only | --tests-only] [ctest args...]
#   --build-only  builds the instrumented targets and runs nothing
#   --tests-only  runs the tests of an instrumented build made before
#
# libtorch is not instrumented; docs/design.md ("Sanitizers") says what that
# means for the options below.
set -euo pipefail
cd "$(dirname "$0")/.."
export HP_BUILD_DIR=${HP_SANITIZE_BUILD_DIR:-build-asan}
build=$HP_BUILD_DIR
steps=all
case "${1:-}" in
  --build-only) steps=build; shift ;;
  --tests-only) steps=tests; shift ;;
esac

# -fno-omit-frame-pointer: ASan's stack traces (and LeakSanitizer's, taken
# at every malloc) unwind by frame pointers. -O1 -g1: instrumented code
# runs close to -O2 speed and reports name lines, at a third of -O3's
# compile time. _GLIBCXX_ASSERTIONS: an index past a std::vector's size but
# within its capacity is no ASan error (the memory is allocated), so
# libstdc++'s own bounds checks abort on it, in every layer (hprun's
# launcher has them in every build: tools/hprun/CMakeLists.txt).
flags="-fsanitize=address,undefined -fno-omit-frame-pointer -D_GLIBCXX_ASSERTIONS"
if [ $steps != tests ]; then
  HP_BUILD_TARGETS="hprun hp-train test_dist_unit test_dist failure_scenarios
    test_checkpoint test_checkpoint_sharded test_checkpoint_jobs test_checkpoint_async
    test_checkpoint_pipeline test_pp_ranks pipeline_failure hp_launcher_tests test_hp_train test_hp_train_data test_hp_train_runs" \
  HP_BUILD_JOBS=${HP_BUILD_JOBS:-$(nproc)} \
    bash scripts/build.sh "-DCMAKE_CXX_FLAGS=$flags" "-DCMAKE_CXX_FLAGS_RELEASE=-O1 -g1 -DNDEBUG"
fi
[ $steps != build ] || exit 0
[ -f "$build/CTestTestfile.cmake" ] ||
  { echo "sanitize: no instrumented build in $build: run scripts/sanitize.sh --build-only first" >&2; exit 1; }

# halt_on_error: the first error ends the process with exit status 1 (ASan
# stops at its first error anyway; UBSan would otherwise report and go on),
# so a rank, hprun or a test binary cannot pass past one. print_stacktrace:
# UBSan's reports name only the line without it. Reports go to stderr: with
# GCC, ASan and UBSan are two runtimes (libasan, libubsan), and libubsan
# ignores log_path while libasan is loaded.
# Leaks are checked at every exit; scripts/sanitizers/lsan.supp lists the
# deliberate ones (with why).
export ASAN_OPTIONS="halt_on_error=1"
export LSAN_OPTIONS="suppressions=$(pwd)/scripts/sanitizers/lsan.supp:print_suppressions=0"
export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1"

# The five layers' tests; see docs/design.md ("Sanitizers") for why these.
# Verbose, into a log: a test that expects a process to fail (a rank that
# dies, a bad flag) passes on its status or message, and ctest keeps no
# output of a passing test, but a sanitizer report in it must fail the run.
log=$build/sanitizers.log
status=0
# Of hp-train's checkpoint runs, two: one of the other modes (save, resume,
# other meshes) and one of the pipeline (its stages to one process and
# back); the other ten (170 s instrumented, a third of the phase's tests)
# run their paths through the same code (docs/design.md, "Sanitizers").
checkpoint_runs='HpTrainCheckpoints\.(ResumeEqualsAnUninterruptedRunAndMovesToOtherMeshes|PipelineCheckpointsMoveToOneProcessAndBack)$'
tests="^(dist\.|checkpoint\.|pp\.(pipeline|failure)\.|launcher\.|hp_train\.(unit$|data$|(HpTrainInit|Chaos)\.|$checkpoint_runs))"
ctest --test-dir "$build" -V -j2 -R "$tests" "$@" \
      > "$log" 2>&1 || status=$?
grep -E '^ *[0-9]+/[0-9]+ Test +#|tests passed|^Total Test time' "$log" || true
if [ $status -ne 0 ]; then
  # Each failed test's output (ctest -V prefixes its lines with "<number>: ").
  for n in $(sed -n '/The following tests FAILED/,$s/^[[:space:]]*\([0-9][0-9]*\) - .*/\1/p' "$log"); do
    echo "=== output of test #$n"
    grep "^$n: " "$log" || true
  done
fi
if grep -nE ': runtime error: |ERROR: (AddressSanitizer|LeakSanitizer)' "$log"; then
  echo "sanitize: sanitizer reports above (whole output: $log)" >&2
  status=1
fi
exit $status
