#!/usr/bin/env bash
# Installs everything the project needs, and nothing else:
#   1. Debian packages (apt-get): the toolchain, Gloo's headers, CLI11,
#      nlohmann-json, fmt, GoogleTest, the fortunes, and Debian's libtorch
#      1.13 (whose headers the compile check uses; HP_LIBTORCH=debian builds
#      and tests against it);
#   2. the project's Python environment .venv with the pinned PyTorch 2.x
#      wheel, whose libtorch the default build uses (scripts/python-env.sh).
# Idempotent: what is present is skipped, so a second run is quick and needs
# no network. Must run as root (or with sudo available).
#
# HP_LIBTORCH=debian also installs Debian's python3-torch, the oracle of a
# build against Debian's libtorch, and skips the environment.
set -euo pipefail
cd "$(dirname "$0")/.."

PACKAGES=(
  # toolchain
  g++ cmake ninja-build make pkg-config
  # Debian's libtorch 1.13 (compile check, HP_LIBTORCH=debian), Gloo's
  # headers (every libtorch: the wheels ship none), its fast BLAS
  libtorch-dev libgloo-dev libopenblas0-pthread
  # tests, CLI, JSON, logging
  libgtest-dev libgmock-dev libcli11-dev nlohmann-json3-dev libfmt-dev
  # real data for the main job
  fortunes fortunes-min
  # ip(8): the two-host launcher tests join two network namespaces
  iproute2
  # the interpreter the Python environment is made from
  python3 python3-venv
)
if [ "${HP_LIBTORCH:-venv}" = debian ]; then
  PACKAGES+=(python3-torch python3-numpy python3-matplotlib)
fi

missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#PACKAGES[@]} Debian packages present"
else
  SUDO=""
  if [ "$(id -u)" -ne 0 ]; then
    SUDO="sudo"
  fi
  echo "install-deps: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq ||
    { echo "install-deps: apt-get update failed: Debian's archive cannot be reached (above)" >&2; exit 1; }
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" ||
    { echo "install-deps: apt-get could not install ${missing[*]} (above)" >&2; exit 1; }
fi

if [ "${HP_LIBTORCH:-venv}" = venv ]; then
  bash scripts/python-env.sh
fi
