#!/usr/bin/env bash
# Installs a built tree into a temporary prefix, builds
# examples/installed_package against it with find_package(HyperParallel), as
# a program outside the project would, and runs it on 2 ranks with the
# installed hprun. ctest runs it (package.installed_example).
#
# Usage: scripts/check-package.sh [BUILD_DIR]   (default: build)
# The example names only the prefix (and the build's compiler launcher): the
# package finds the libtorch it was built with (cmake/HPInstall.cmake).
set -euo pipefail
cd "$(dirname "$0")/.."
build=$(cd "${1:-build}" && pwd)
start=$(date +%s)
prefix=$(mktemp -d "${TMPDIR:-/tmp}/hp-package.XXXXXX")
trap 'rm -rf "$prefix"' EXIT

cache_value() { sed -n "s/^$1:[A-Z]*=//p" "$build/CMakeCache.txt" | head -1; }
launcher=$(cache_value CMAKE_CXX_COMPILER_LAUNCHER)

cmake --install "$build" --prefix "$prefix" >/dev/null
for f in bin/hprun bin/hp-train include/hp/fsdp/fully_shard.h \
         lib/cmake/HyperParallel/HyperParallelConfig.cmake \
         lib/cmake/HyperParallel/HyperParallelConfigVersion.cmake; do
  [ -e "$prefix/$f" ] || { echo "check-package: $f is not installed" >&2; exit 1; }
done

args=(-S examples/installed_package -B "$prefix/example-build" -G Ninja
      -DCMAKE_BUILD_TYPE=Release "-DCMAKE_PREFIX_PATH=$prefix")
[ -n "$launcher" ] && args+=("-DCMAKE_CXX_COMPILER_LAUNCHER=$launcher")
cmake "${args[@]}" >/dev/null
cmake --build "$prefix/example-build"
OMP_NUM_THREADS=1 "$prefix/bin/hprun" -n 2 --timeout 300 "$prefix/example-build/fsdp_train"
echo "check-package: installed, built against the package and ran on 2 ranks in" \
     "$(( $(date +%s) - start )) s"
