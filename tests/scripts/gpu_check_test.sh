#!/usr/bin/env bash
# scripts/gpu-check.sh where no GPU is: bad arguments are refused with the
# usage, a machine without a GPU is refused at once (status 3), and with
# HP_GPU_CHECK_ALLOW_CPU=1 the steps that can run without one write both
# summaries in their documented shape (the CUDA tests skip on the CPU).
# Usage: gpu_check_test.sh SOURCE_DIR BUILD_DIR PYTHON
set -uo pipefail
src=$1 build=$2 python=$3
script=$src/scripts/gpu-check.sh
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
source "$(dirname "$0")/expect.sh"

expect unknown-step 2 "gpu-check: unknown step 'tset'; usage: scripts/gpu-check.sh [--out DIR] [STEP...]; steps: versions probe build tests train bench" \
  env HP_PYTHON="$python" bash "$script" tset
expect out-without-folder 2 "gpu-check: --out needs a folder" \
  env HP_PYTHON="$python" bash "$script" --out
expect no-torch 3 "has no torch: set HP_PYTHON" env HP_PYTHON=/bin/false bash "$script" versions
expect no-python 3 "no Python 'no-such-python'" env HP_PYTHON=no-such-python bash "$script" versions
if [ "$("$python" -c 'import torch; print(torch.cuda.device_count())')" != 0 ]; then
  echo "a GPU is visible: the no-GPU cases do not apply"
else
  expect no-gpu 3 "gpu-check: no GPU visible (torch.cuda.device_count() is 0" \
    env HP_PYTHON="$python" bash "$script" --out "$tmp/refused"
  [ ! -e "$tmp/refused" ] || { echo "FAIL no-gpu: it wrote $tmp/refused"; failures=$((failures + 1)); }

  # The CUDA tests through the project's build: on the CPU they skip and
  # pass; NCCL with shared ranks is skipped (no probe ran, no GPU).
  expect cpu-tests 0 "tests.gloo.n4" env HP_PYTHON="$python" HP_GPU_CHECK_ALLOW_CPU=1 \
    HP_GPU_BUILD="$build" bash "$script" --out "$tmp/out" tests
  "$python" - "$tmp/out" <<'PY' || failures=$((failures + 1))
import json, os, sys
out = sys.argv[1]
s = json.load(open(os.path.join(out, "summary.json")))
steps = {x["step"]: x for x in s["steps"]}
problems = []
if s["card"] != "no GPU":
    problems.append(f"card {s['card']!r}")
for name in ("tests.nccl.n1", "tests.gloo.n2", "tests.gloo.n4"):
    step = steps.get(name)
    if not step or step.get("result") != "ok" or not isinstance(step.get("seconds"), int):
        problems.append(f"{name}: {step}")
    elif not any("PASSED" in f for f in step["figures"]):
        problems.append(f"{name} has no test count: {step['figures']}")
for name in ("tests.nccl.n2", "tests.nccl.n4"):
    if not steps.get(name, {}).get("result", "").startswith("skipped: NCCL refused"):
        problems.append(f"{name}: {steps.get(name)}")
text = open(os.path.join(out, "summary.txt")).read()
if not text.startswith("gpu-check on no GPU (0 visible), "):
    problems.append("summary.txt header: " + text.splitlines()[0])
if not os.path.isfile(os.path.join(out, "logs.tar.gz")):
    problems.append("no logs.tar.gz")
for p in problems:
    print("FAIL summary:", p)
print("ok   summary" if not problems else "")
sys.exit(1 if problems else 0)
PY
fi
[ "$failures" -eq 0 ]
