#!/usr/bin/env bash
# Configures and builds the project (Release, Ninja).
# Usage: scripts/build.sh [extra cmake args...]
#
# Which libtorch, by HP_LIBTORCH:
#   venv (default)   the PyTorch 2.x wheel of the project's environment, .venv or
#                    HP_VENV (scripts/python-env.sh); build directory build/
#   debian           Debian's libtorch-dev (1.13, CPU); build directory build-debian/
#   PATH             a Python interpreter whose torch to use (e.g. a GPU machine's
#                    /usr/bin/python3), or the root of a libtorch distribution
#                    (pytorch.org's zip); build directory build-other/
# HP_BUILD_DIR overrides the build directory. The Python the tests' oracles and
# hp-bench's baselines run (HP_PYTHON in CMake) is the environment's for venv,
# the interpreter itself for a Python PATH, /usr/bin/python3 otherwise.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/build-dir.sh
jobs=${HP_BUILD_JOBS:-$(nproc)}
libtorch=${HP_LIBTORCH:-venv}
build=$(hp_build_dir)

torch_root_of() {  # the torch package directory of the Python $1
  "$1" -c 'import os, torch; print(os.path.dirname(torch.__file__))' ||
    { echo "build: $1 has no usable torch" >&2; exit 1; }
}

case "$libtorch" in
  venv)
    venv=$(realpath -m "${HP_VENV:-.venv}")
    [ -x "$venv/bin/python" ] || { echo "build: no environment at $venv: run scripts/install-deps.sh first" >&2; exit 1; }
    python=$venv/bin/python
    prefix=$(torch_root_of "$python") ;;
  debian)
    prefix=/usr
    python=/usr/bin/python3 ;;
  *)
    if [ -f "$libtorch" ] && [ -x "$libtorch" ]; then
      python=$libtorch
      prefix=$(torch_root_of "$python")
    elif [ -d "$libtorch" ]; then
      python=/usr/bin/python3
      prefix=$(cd "$libtorch" && pwd)
    else
      echo "build: HP_LIBTORCH='$libtorch': expected venv, debian, a Python interpreter or a libtorch directory" >&2
      exit 1
    fi ;;
esac

cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release "-DCMAKE_PREFIX_PATH=$prefix" \
      "-DHP_PYTHON=$python" "$@" >/dev/null
# HP_BUILD_TARGETS: only these targets (scripts/sanitize.sh), instead of all.
ninja -C "$build" -j "$jobs" ${HP_BUILD_TARGETS:-}
