#!/usr/bin/env bash
# Makes the project's Python environment: .venv in the repository (ignored
# by git), with exactly the versions of scripts/python-requirements.txt
# (PyTorch 2.x, whose libtorch the build uses, numpy, matplotlib).
#
# Idempotent: an environment whose stamp (.venv/.hp-env) matches the
# requirements and the interpreter is kept, so a second run takes a second
# and needs no network. Anything else at .venv (a half-made environment from
# an interrupted or failed run, other versions) is removed and made again:
# the stamp is written last, after torch, numpy and matplotlib import and
# report the pinned versions.
#
# Environment:
#   HP_VENV    where the environment lives (default: .venv in the repository)
#   HP_PYTHON  the interpreter it is made from (default: Debian's /usr/bin/python3,
#              else python3 on PATH); PyTorch 2.15 needs Python >= 3.11
# Exit status: 0 when the environment is ready, 1 with a message saying what
# could not be installed and why.
set -euo pipefail
cd "$(dirname "$0")/.."

requirements=scripts/python-requirements.txt
venv=${HP_VENV:-.venv}
need_gib=9  # the environment is ~5.5 GiB; pip unpacks the wheels beside it

fail() {
  echo "python-env: $*" >&2
  exit 1
}

python=${HP_PYTHON:-}
if [ -z "$python" ]; then
  if [ -x /usr/bin/python3 ]; then python=/usr/bin/python3; else python=$(command -v python3 || true); fi
fi
[ -n "$python" ] && [ -x "$(command -v "$python")" ] ||
  fail "no Python interpreter found (HP_PYTHON='${HP_PYTHON:-}', no python3 on PATH): install python3 (Debian: apt-get install python3 python3-venv)"
version=$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
"$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' ||
  fail "$python is Python $version, too old: torch==2.15.0 needs Python >= 3.11 (set HP_PYTHON to a newer one)"
"$python" -c 'import venv, ensurepip' 2>/dev/null ||
  fail "$python cannot make environments (no venv/ensurepip module): apt-get install python3-venv"

stamp_text="$(sha256sum "$requirements" | cut -d' ' -f1) python $("$python" -c 'import sys; print(sys.version.split()[0])')"
if [ -f "$venv/.hp-env" ] && [ "$(cat "$venv/.hp-env")" = "$stamp_text" ] &&
   "$venv/bin/python" -c 'import torch' 2>/dev/null; then
  echo "python-env: $venv ready ($(grep -m1 '^torch==' "$requirements"))"
  exit 0
fi

if [ -e "$venv" ]; then
  echo "python-env: $venv is incomplete or out of date: removing it and making it again"
  rm -rf "$venv"
fi

parent=$(dirname "$venv")
mkdir -p "$parent"
free_kib=$(df -Pk "$parent" | awk 'NR == 2 { print $4 }')
[ "$free_kib" -ge $((need_gib * 1024 * 1024)) ] ||
  fail "only $((free_kib / 1024 / 1024)) GiB free under $(cd "$parent" && pwd), the environment needs about $need_gib GiB: free some space (or set HP_VENV elsewhere)"

# A failed run leaves nothing that a later run could take for ready.
cleanup() { [ -f "$venv/.hp-env" ] || rm -rf "$venv"; }
trap cleanup EXIT

start=$(date +%s)
echo "python-env: making $venv with Python $version ($python), installing $requirements"
"$python" -m venv "$venv" || fail "'$python -m venv $venv' failed"
log=$(mktemp)
if ! "$venv/bin/python" -m pip install --no-cache-dir --disable-pip-version-check -q \
       -r "$requirements" >"$log" 2>&1; then
  tail -n 15 "$log" >&2
  if grep -qiE 'No space left on device|Errno 28' "$log"; then
    fail "pip ran out of disk space under $(cd "$parent" && pwd): free some space and run again"
  elif grep -qiE 'from versions: none|NewConnectionError|Max retries|Temporary failure in name resolution|Network is unreachable|ConnectTimeout|SSLError|ProxyError' "$log"; then
    # No version of a package at all: the registry did not answer, or has no
    # wheel for this interpreter and platform. Asking it for torch's
    # versions tells which.
    if "$venv/bin/python" -m pip index versions torch >/dev/null 2>&1; then
      fail "the package registry answers but has no wheel of a pinned package (above) for Python $version on $(uname -m): torch==2.15.0 needs CPython >= 3.11 on Linux x86-64 or aarch64"
    fi
    fail "cannot reach the Python package registry (pip's error above): the environment needs a network path to it, or a pip configuration (index-url, find-links) that serves these wheels"
  elif grep -qiE 'Could not find a version|No matching distribution' "$log"; then
    fail "the package registry has no wheel of a pinned version (above) for Python $version on $(uname -m)"
  fi
  fail "pip could not install $requirements (its last lines are above)"
fi
rm -f "$log"

# Ready only when what the project uses imports and has the pinned version.
"$venv/bin/python" - "$requirements" <<'EOF' || fail "the environment was installed but does not work (above)"
import sys
pins = dict(line.strip().split("==") for line in open(sys.argv[1])
            if "==" in line and not line.startswith("#"))
import torch, numpy, matplotlib  # noqa: E401
for name, module in (("torch", torch), ("numpy", numpy), ("matplotlib", matplotlib)):
    got = module.__version__.split("+")[0]
    if got != pins[name]:
        sys.exit(f"python-env: {name} {got} was installed, {pins[name]} is pinned")
EOF
echo "$stamp_text" >"$venv/.hp-env"
echo "python-env: $venv ready in $(( $(date +%s) - start )) s ($(du -sh "$venv" | cut -f1))"
