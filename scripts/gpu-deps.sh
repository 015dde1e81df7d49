#!/usr/bin/env bash
# Fetches, on a machine with apt, what scripts/gpu-check.sh needs on a GPU
# machine that has PyTorch but no network and no package manager: the
# header-only build dependencies the PyTorch wheel lacks (Gloo's headers,
# CLI11, nlohmann-json, GoogleTest and gmock) and the fortunes corpus, as
# Debian .deb files in one folder (a few MB). gpu-check.sh unpacks them with
# dpkg -x into a prefix outside the source tree.
#
#   bash scripts/gpu-deps.sh [DIR]     # default .gpu/debs (ignored by git)
#
# Idempotent: packages already in DIR are not fetched again.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-.gpu/debs}
packages=(libgloo-dev libcli11-dev nlohmann-json3-dev libgtest-dev libgmock-dev fortunes-min fortunes)
mkdir -p "$dir"
missing=()
for p in "${packages[@]}"; do
  compgen -G "$dir/${p}_*.deb" >/dev/null || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "gpu-deps: all ${#packages[@]} packages in $dir"
  exit 0
fi
command -v apt-get >/dev/null || { echo "gpu-deps: needs apt-get (Debian or Ubuntu)" >&2; exit 1; }
# apt-get download runs as _apt where it can; a folder only root can write
# makes it warn, so fetch into a temporary folder it can write and move.
tmp=$(mktemp -d)
chmod 755 "$tmp"
trap 'rm -rf "$tmp"' EXIT
if ! (cd "$tmp" && apt-get download "${missing[@]}" >/dev/null 2>&1); then
  apt-get update -qq ||
    { echo "gpu-deps: apt-get update failed: Debian's archive cannot be reached" >&2; exit 1; }
  (cd "$tmp" && apt-get download "${missing[@]}") ||
    { echo "gpu-deps: apt-get could not download ${missing[*]}" >&2; exit 1; }
fi
mv "$tmp"/*.deb "$dir"/
echo "gpu-deps: ${missing[*]} fetched into $dir ($(du -sh "$dir" | cut -f1))"
