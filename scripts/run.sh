#!/usr/bin/env bash
# Quick start, command 1: installs what is missing, builds, and runs the main
# job: hp-train, a GPT trained on Debian's fortunes with FSDP on 2 local
# ranks (a few minutes). Extra arguments go to hp-train (hp-train --help).
# HP_LIBTORCH chooses the libtorch as for scripts/build.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/build-dir.sh
bash scripts/install-deps.sh
bash scripts/build.sh
build=$(hp_build_dir)
exec "$build/tools/hprun/hprun" -n 2 "$build/tools/hp_train/hp-train" "$@"
