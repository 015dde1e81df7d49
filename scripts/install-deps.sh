#!/usr/bin/env bash
# Installs every Debian package the project needs, and nothing else.
# Idempotent: packages already present are skipped, so a second run is quick
# and needs no network. Must run as root (or with sudo available).
set -euo pipefail

PACKAGES=(
  # toolchain
  g++ cmake ninja-build make pkg-config
  # unpacks the libtorch 2.11 headers of the compile-only check
  xz-utils
  # tensors, autograd, c10d (Gloo) and its headers; fast BLAS
  libtorch-dev libgloo-dev libopenblas0-pthread
  # tests, CLI, JSON, logging
  libgtest-dev libgmock-dev libcli11-dev nlohmann-json3-dev libfmt-dev
  # real data for the main job
  fortunes fortunes-min
  # baselines and plots for the benchmarks (PyTorch 1.13 DDP, matplotlib)
  python3 python3-torch python3-numpy python3-matplotlib
)

missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#PACKAGES[@]} packages present"
  exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  SUDO="sudo"
fi
echo "install-deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
