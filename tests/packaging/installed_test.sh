#!/usr/bin/env bash
# The installed package as a program outside the project sees it
# (cmake/HPInstall.cmake):
#   1. `cmake --install` into a temporary prefix;
#   2. the installed hp-train loads the libtorch it was built with, from its
#      own run path (no LD_LIBRARY_PATH), and runs (--dry-run: a plan, no
#      ranks, no step);
#   3. a tiny consumer (consumer/) configured with only the prefix in
#      CMAKE_PREFIX_PATH builds, links the package's static libraries with
#      that libtorch, and runs;
#   4. where another libtorch version is on the machine (Debian's 1.13, which
#      scripts/install-deps.sh installs), a consumer pointed at it
#      (-DTorch_DIR) fails at configure time with a message naming both
#      versions, not at link time.
# Usage: installed_test.sh SOURCE_DIR BUILD_DIR   (ctest: package.installed)
set -euo pipefail
source=$(cd "$1" && pwd)
build=$(cd "$2" && pwd)
work=$(mktemp -d "${TMPDIR:-/tmp}/hp-installed.XXXXXX")
trap 'rm -rf "$work"' EXIT
prefix=$work/prefix
fail() { echo "installed_test: $*" >&2; exit 1; }
# Nothing but the binaries' own run paths decides which libraries load.
unset LD_LIBRARY_PATH

cache_value() { sed -n "s/^$1:[A-Z]*=//p" "$build/CMakeCache.txt" | head -1; }
torch_library=$(cache_value TORCH_LIBRARY)
[ -n "$torch_library" ] || fail "$build/CMakeCache.txt names no TORCH_LIBRARY"
torch_lib_dir=$(dirname "$(realpath "$torch_library")")
launcher=$(cache_value CMAKE_CXX_COMPILER_LAUNCHER)
config_version() {  # the version a Torch_DIR's TorchConfigVersion.cmake gives
  sed -n 's/^set(PACKAGE_VERSION "\(.*\)")$/\1/p' "$1/TorchConfigVersion.cmake"
}
torch_version=$(config_version "$(cache_value Torch_DIR)")
[ -n "$torch_version" ] || fail "no libtorch version in $(cache_value Torch_DIR)"

cmake --install "$build" --prefix "$prefix" >/dev/null

# 2. hp-train: its run path, which libtorch the loader picks, then a run. An
# empty entry in a run path is the working directory, where the loader would
# then look for every library (libstdc++ included) before the system's.
runpath=$(readelf -d "$prefix/bin/hp-train" | sed -n 's/.*(RUNPATH).*\[\(.*\)\]$/\1/p')
case ":$runpath:" in
  ::) fail "the installed hp-train has no run path" ;;
  *::*) fail "the installed hp-train's run path has an empty entry: '$runpath'" ;;
esac
ldd_out=$(ldd "$prefix/bin/hp-train")
if grep -q 'not found' <<<"$ldd_out"; then
  fail "the installed hp-train misses libraries:"$'\n'"$(grep 'not found' <<<"$ldd_out")"
fi
loaded=$(sed -n 's/^[[:space:]]*libtorch_cpu\.so => \([^ ]*\) .*/\1/p' <<<"$ldd_out")
[ -n "$loaded" ] || fail "the installed hp-train loads no libtorch_cpu.so:"$'\n'"$ldd_out"
[ "$(dirname "$(realpath "$loaded")")" = "$torch_lib_dir" ] ||
  fail "the installed hp-train loads $loaded, not the libtorch it was built with ($torch_lib_dir)"
OMP_NUM_THREADS=1 "$prefix/bin/hp-train" --dry-run > "$work/dry-run.txt" 2>&1 ||
  { cat "$work/dry-run.txt" >&2; fail "the installed hp-train --dry-run failed"; }
echo "installed_test: the installed hp-train loads $loaded and runs --dry-run"

# 3. The consumer, with nothing but the prefix.
args=(-G Ninja -DCMAKE_BUILD_TYPE=Release "-DCMAKE_PREFIX_PATH=$prefix")
[ -n "$launcher" ] && args+=("-DCMAKE_CXX_COMPILER_LAUNCHER=$launcher")
cmake -S "$source/tests/packaging/consumer" -B "$work/consumer" "${args[@]}" \
      > "$work/configure.txt" 2>&1 ||
  { cat "$work/configure.txt" >&2; fail "the consumer did not configure with only the prefix"; }
cmake --build "$work/consumer" > "$work/build.txt" 2>&1 ||
  { cat "$work/build.txt" >&2; fail "the consumer did not build with only the prefix"; }
"$work/consumer/consumer" "$work/t.safetensors"

# 4. Another libtorch, named by the program: refused when configuring.
other=""
for dir in /usr/lib/*-linux-gnu/cmake/Torch /usr/share/cmake/Torch; do
  [ -f "$dir/TorchConfigVersion.cmake" ] && other=$dir && break
done
if [ -z "$other" ]; then
  echo "installed_test: no second libtorch on this machine, step 4 left out"
  exit 0
fi
other_version=$(config_version "$other")
if [ "$other_version" = "$torch_version" ]; then
  echo "installed_test: $other is libtorch $torch_version too, step 4 left out"
  exit 0
fi
if cmake -S "$source/tests/packaging/consumer" -B "$work/mismatch" "${args[@]}" \
         "-DTorch_DIR=$other" > "$work/mismatch.txt" 2>&1; then
  fail "a consumer pointed at libtorch $other_version ($other) configured; expected a refusal"
fi
message=$(tr -s ' \n' ' ' < "$work/mismatch.txt")
for want in "built against libtorch $torch_version" "finds libtorch $other_version"; do
  grep -qF "$want" <<<"$message" ||
    { cat "$work/mismatch.txt" >&2; fail "the refusal does not say '$want'"; }
done
echo "installed_test: a consumer pointed at libtorch $other_version is refused at configure time"
