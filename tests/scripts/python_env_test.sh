#!/usr/bin/env bash
# scripts/python-env.sh when it cannot make the environment: it must say
# why, exit non-zero, and leave nothing that a later run could take for a
# ready environment. Nothing here downloads: the registry is an unused
# loopback port, and each case fails before pip would fetch a wheel.
# Usage: python_env_test.sh SOURCE_DIR
set -uo pipefail
src=$1
script=$src/scripts/python-env.sh
tmp=$(mktemp -d)
trap 'umount "$tmp/small" 2>/dev/null; rm -rf "$tmp"' EXIT
source "$(dirname "$0")/expect.sh"

# expect_env NAME STATUS TEXT -- ENV...: python-env.sh run with ENV.
expect_env() {
  local name=$1 status=$2 text=$3
  shift 4
  expect "$name" "$status" "$text" env "$@" bash "$script"
}

expect_env "no interpreter" 1 "no Python interpreter found" -- \
  HP_VENV="$tmp/venv" HP_PYTHON="$tmp/no-such-python"

# An interpreter that reports Python 3.9.
cat >"$tmp/python3.9" <<'EOF'
#!/bin/sh
if [ "$1" = -c ]; then
  exec python3 -c "import sys; sys.version_info = (3, 9, 18, 'final', 0); exec(sys.argv.pop(1))" "$2"
fi
exec python3 "$@"
EOF
chmod +x "$tmp/python3.9"
expect_env "python too old" 1 "is Python 3.9, too old: torch==2.15.0 needs Python >= 3.11" -- \
  HP_VENV="$tmp/venv" HP_PYTHON="$tmp/python3.9"

# A half-made environment (no stamp) and no path to the registry: the
# leftover is removed, the failure names the registry, nothing is left.
mkdir -p "$tmp/venv/lib"
touch "$tmp/venv/lib/half-written"
offline=(PIP_INDEX_URL=http://127.0.0.1:9/simple PIP_FIND_LINKS= PIP_NO_INDEX= PIP_RETRIES=0
         PIP_DEFAULT_TIMEOUT=3 PIP_CONFIG_FILE=/dev/null)
expect_env "incomplete environment is not kept" 1 "is incomplete or out of date: removing it" -- \
  HP_VENV="$tmp/venv" "${offline[@]}"
mkdir -p "$tmp/venv/lib"
expect_env "registry unreachable" 1 "cannot reach the Python package registry" -- \
  HP_VENV="$tmp/venv" "${offline[@]}"
if [ -e "$tmp/venv" ]; then
  echo "FAIL registry unreachable: $tmp/venv was left behind"
  failures=$((failures + 1))
fi

# Too little disk: a 64 MiB file system (needs root to mount; skipped otherwise).
mkdir -p "$tmp/small"
if mount -t tmpfs -o size=64M tmpfs "$tmp/small" 2>/dev/null; then
  expect_env "too little space" 1 "GiB free under $tmp/small, the environment needs about" -- \
    HP_VENV="$tmp/small/venv" "${offline[@]}"
else
  echo "skip too little space: cannot mount a small file system here (not root?)"
fi

if [ "$failures" -ne 0 ]; then
  echo "$failures case(s) failed"
  exit 1
fi
echo "every case passed"
