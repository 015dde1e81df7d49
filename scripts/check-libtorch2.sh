#!/usr/bin/env bash
# Compile-only check of every project source file against libtorch 2.x
# headers (third_party/libtorch-2.11: the 2.11.0 wheel's include/, no
# binaries), so that support for 2.x cannot rot on a machine that has only
# Debian's libtorch 1.13. Each .cpp under hp/ tools/ tests/ bench/ examples/
# gets `g++ -fsyntax-only` with the flags the wheel's CMake targets give a CPU
# translation unit, plus the file's own -D definitions from
# build/compile_commands.json when a configured build exists. The torch
# headers are precompiled once.
#
# Usage: scripts/check-libtorch2.sh [-j N] [FILE.cpp...]   (default: -j 2, every file)
# Environment: HP_LIBTORCH2_DIR  where to unpack (default: build/libtorch-2.11)
set -euo pipefail
cd "$(dirname "$0")/.."

jobs=2
if [ "${1:-}" = "-j" ]; then
  jobs=$2
  shift 2
fi

tarball=third_party/libtorch-2.11/torch-2.11.0-include.tar.xz
dir=${HP_LIBTORCH2_DIR:-build/libtorch-2.11}
start=$(date +%s)

# Unpack once per tarball (the stamp holds its checksum).
sum=$(sha256sum "$tarball" | cut -d' ' -f1)
if [ "$(cat "$dir/.stamp" 2>/dev/null)" != "$sum" ]; then
  rm -rf "$dir"
  mkdir -p "$dir"
  tar -xJf "$tarball" -C "$dir"
  echo "$sum" >"$dir/.stamp"
fi
inc=$(cd "$dir" && pwd)/include

# The wheel's CMake targets for a CPU translation unit (torch_cpu's
# interface definitions, the C++11 ABI). Gloo's headers come from
# libgloo-dev in /usr/include: the wheel ships none. fmt is the wheel's,
# header-only, as cmake/HPFmt.cmake builds it.
flags=(-std=c++17 -fsyntax-only -D_GLIBCXX_USE_CXX11_ABI=1 -DUSE_DISTRIBUTED -DUSE_C10D_GLOO
       -DFMT_HEADER_ONLY=1
       -isystem "$inc" -isystem "$inc/torch/csrc/api/include" -I. -Winvalid-pch)

# One precompiled header for everything: the project's two PCH lists.
pch_dir="$dir/pch"
mkdir -p "$pch_dir"
printf '#include "cmake/pch_torch.h"\n' >"$pch_dir/hp_pch.h"
pch_key=$(cat cmake/pch_aten.h cmake/pch_torch.h "$dir/.stamp" | sha256sum | cut -d' ' -f1)
pch_key="$pch_key $(g++ --version | head -1)"
if [ "$(cat "$pch_dir/.key" 2>/dev/null)" != "$pch_key" ]; then
  pch_flags=()
  for f in "${flags[@]}"; do [ "$f" = -fsyntax-only ] || pch_flags+=("$f"); done
  g++ "${pch_flags[@]}" -x c++-header "$pch_dir/hp_pch.h" -o "$pch_dir/hp_pch.h.gch"
  echo "$pch_key" >"$pch_dir/.key"
fi

if [ $# -gt 0 ]; then
  files=("$@")
else
  mapfile -t files < <(git ls-files 'hp/*.cpp' 'tools/*.cpp' 'tests/*.cpp' 'bench/*.cpp' \
                                    'examples/*.cpp')
fi

# Per-file -D definitions (paths some tests and tools are built with).
defs_file="$dir/defs.txt"
python3 - "${files[@]}" >"$defs_file" <<'EOF'
import json, os, shlex, sys
defs = {}
try:
    with open("build/compile_commands.json") as f:
        for entry in json.load(f):
            path = os.path.relpath(entry["file"], os.getcwd())
            args = entry.get("arguments") or shlex.split(entry["command"])
            # The file's own definitions; not those that 1.13's libtorch, the
            # system's fmt, glog or the build type add (the flags above stand
            # for libtorch's, and the precompiled header has no NDEBUG).
            foreign = ("USE_", "_GLIBCXX_", "FMT_", "GFLAGS_", "GLOG_", "NDEBUG")
            defs[path] = [a for a in args
                          if a.startswith("-D") and not a[2:].startswith(foreign)]
except FileNotFoundError:
    pass
for path in sys.argv[1:]:
    # A test's path macros only have to be string literals to compile.
    fallback = ['-DHP_SOURCE_DIR="."', '-DHPRUN_PATH="hprun"', '-DHP_BENCH_SOURCE_DIR="."',
                '-DHP_TRAIN_PATH="hp-train"', '-DDTENSOR_DEMO_PATH="dtensor_demo"',
                '-DHP_PYTHON="python3"']
    print(path + "\t" + " ".join(shlex.quote(d) for d in defs.get(path, fallback)))
EOF

log_dir="$dir/logs"
rm -rf "$log_dir"
mkdir -p "$log_dir"
export HP_CHECK_FLAGS="${flags[*]@Q} -include ${pch_dir@Q}/hp_pch.h" HP_CHECK_LOGS="$log_dir"
# Each line: FILE<TAB>DEFS. A failing file leaves FILE's log behind.
tr '\t' '\n' <"$defs_file" | xargs -d '\n' -n 2 -P "$jobs" sh -c '
  log="$HP_CHECK_LOGS/$(echo "$0" | tr / _).log"
  if eval "g++ $HP_CHECK_FLAGS $1 \"\$0\"" >"$log" 2>&1; then rm -f "$log"; else echo "FAIL $0"; fi
' || true

failed=$(find "$log_dir" -name '*.log' | wc -l)
for log in "$log_dir"/*.log; do
  [ -e "$log" ] || continue
  echo "== $(basename "$log" .log)"
  head -40 "$log"
done
echo "check-libtorch2: ${#files[@]} files against libtorch 2.11 headers, $failed failed," \
     "$(( $(date +%s) - start )) s"
[ "$failed" -eq 0 ]
