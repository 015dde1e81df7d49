#!/usr/bin/env bash
# Checks the CUDA path on a GPU machine in about ten minutes, as one run
# (docs/gpu.md). Written for a machine with PyTorch installed with pip
# (python3), a compiler, CMake and ninja, but no network and no package
# manager: the headers the wheel lacks come as Debian packages that
# scripts/gpu-deps.sh fetched beforehand on a machine with apt.
#
#   bash scripts/gpu-check.sh [--out DIR] [STEP...]
#
# Steps, in this order (all of them by default):
#   versions  the card, driver, torch, CUDA and NCCL versions
#   probe     whether NCCL takes several ranks on one GPU (distinct NCCL_HOSTID)
#   build     configure and build what the check runs (incremental when the
#             build folder exists; the other steps build only if nothing is built)
#   tests     the CUDA tests on 1 rank (NCCL), 2 and 4 ranks (Gloo, and NCCL
#             where the probe passed)
#   train     hp-train on the GPU: every mode, both models, bf16 parameters
#             with fp32 reduction, checkpoint, resume, export, sampling
#   bench     hp-bench's CUDA rows against PyTorch's FSDP2 and DDP
# Naming steps reruns only those (the build folder is reused).
#
# Each step logs to DIR/logs/STEP.log and is timed; DIR/summary.txt and
# DIR/summary.json list every step's result and figures, labelled with the
# card, and DIR/logs.tar.gz packs the logs. A step that fails does not stop
# the later ones; a failed build does (nothing after it could run).
#
# Environment:
#   HP_PYTHON         the Python whose torch to build against (default python3)
#   HP_GPU_DEPS       the folder of .deb files from scripts/gpu-deps.sh
#                     (default .gpu/debs); unpacked into a prefix in /tmp
#   HP_GPU_BUILD      the build folder (default build-gpu-check); one made
#                     elsewhere against the same wheel is used as it is if
#                     its programs load here
#   HP_GPU_CHECK_ALLOW_CPU=1  run without a GPU (to test this script: the
#                     GPU steps then fail or skip, and say so)
# Exit status: 0 when every step run passed, 1 when one failed, 2 for bad
# arguments, 3 when there is no GPU (or no torch) to check.
set -uo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)

all_steps=(versions probe build tests train bench)
usage="usage: scripts/gpu-check.sh [--out DIR] [STEP...]; steps: ${all_steps[*]}"
out=gpu-check
steps=()
while [ $# -gt 0 ]; do
  case "$1" in
    --out)
      [ $# -ge 2 ] && [ -n "$2" ] || { echo "gpu-check: --out needs a folder; $usage" >&2; exit 2; }
      out=$2
      shift 2 ;;
    -h|--help) echo "$usage"; exit 0 ;;
    *)
      known=0
      for s in "${all_steps[@]}"; do [ "$1" = "$s" ] && known=1; done
      [ $known = 1 ] || { echo "gpu-check: unknown step '$1'; $usage" >&2; exit 2; }
      steps+=("$1")
      shift ;;
  esac
done
[ ${#steps[@]} -gt 0 ] || steps=("${all_steps[@]}")
wanted() { local s; for s in "${steps[@]}"; do [ "$s" = "$1" ] && return 0; done; return 1; }

python=$(command -v "${HP_PYTHON:-python3}") ||
  { echo "gpu-check: no Python '${HP_PYTHON:-python3}': set HP_PYTHON to the Python that has PyTorch" >&2; exit 3; }
torch_dir=$("$python" -c 'import os, torch; print(os.path.dirname(torch.__file__))' 2>/dev/null) ||
  { echo "gpu-check: $python has no torch: set HP_PYTHON to the Python that has PyTorch" >&2; exit 3; }
gpus=$("$python" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
if [ "$gpus" = 0 ] && [ "${HP_GPU_CHECK_ALLOW_CPU:-0}" != 1 ]; then
  echo "gpu-check: no GPU visible (torch.cuda.device_count() is 0 for $python): this script" \
       "checks the CUDA path and needs one; the CPU suite is scripts/test.sh" >&2
  exit 3
fi

out=$(realpath -m "$out")
logs=$out/logs
mkdir -p "$logs" || { echo "gpu-check: cannot create $logs" >&2; exit 2; }
summary=$out/summary.txt
records=$out/.records.tsv  # step, verdict, seconds, figures: summary.json is made from it
: >"$summary"
: >"$records"
failed=0

# The wheel's libraries and those of its CUDA packages, for programs built
# elsewhere whose RUNPATH names another machine's folders.
libpath=$torch_dir/lib
for d in "$torch_dir"/../nvidia/*/lib "$torch_dir"/../nvidia/*/*/lib; do
  [ -d "$d" ] && libpath=$libpath:$(realpath "$d")
done
export LD_LIBRARY_PATH=$libpath${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}

card=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
card=${card:-no GPU}
commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
note() { echo "$*" | tee -a "$summary"; }
note "gpu-check on $card ($gpus visible), $(date -u +%FT%TZ), commit $commit"

# run_step NAME LIMIT CMD...: CMD under timeout, output in logs/NAME.log;
# notes the verdict and the time. Returns CMD's status.
run_step() {
  local name=$1 limit=$2
  shift 2
  local start=$SECONDS rc verdict=ok
  timeout -k 5 "$limit" "$@" >"$logs/$name.log" 2>&1
  rc=$?
  if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
    verdict="timed out after ${limit}s"
  elif [ $rc -ne 0 ]; then
    verdict="FAILED (exit $rc)"
  fi
  [ $rc -eq 0 ] || failed=1
  local took=$((SECONDS - start))
  note "$(printf '%-30s %-22s %4ds' "$name" "$verdict" "$took")"
  printf '%s\t%s\t%s\t\n' "$name" "$verdict" "$took" >>"$records"
  return $rc
}
# figure NAME TEXT: a figure of step NAME, in both summaries.
figure() {
  note "    $2"
  printf '%s\t\t\t%s\n' "$1" "$2" >>"$records"
}
skip() {
  note "$(printf '%-30s %s' "$1" "skipped: $2")"
  printf '%s\tskipped: %s\t0\t\n' "$1" "$2" >>"$records"
}

if wanted versions; then
  run_step versions 60 bash -c "nvidia-smi -L; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    '$python' -c 'import torch, torch.distributed as d; print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, \"nccl\", \".\".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else \"-\", \"gpus\", torch.cuda.device_count())'
    g++ --version | head -1; cmake --version | head -1; echo cores \$(nproc)"
  while read -r line; do figure versions "$line"; done < <(grep -E "^torch|MiB" "$logs/versions.log")
fi

# NCCL refuses two ranks on one GPU by default ("Duplicate GPU detected");
# with a distinct NCCL_HOSTID per rank it should connect them as hosts of
# their own. The library sets that for HP_SHARE_GPUS=1 (docs/gpu.md).
nccl_shares=0
if wanted probe; then
  # NCCL refusing this is the expected answer, not the check's failure.
  failed_before=$failed
  if run_step probe.plain.n2 60 env NCCL_SOCKET_IFNAME=lo "$python" -m torch.distributed.run \
       --standalone --nproc-per-node 2 scripts/gpu/nccl_share_probe.py; then
    figure probe "NCCL took 2 ranks on one GPU without NCCL_HOSTID"
  fi
  failed=$failed_before
  shares=1
  for n in 2 4; do
    run_step "probe.hostid.n$n" 60 env HP_PROBE_HOSTID=1 NCCL_SOCKET_IFNAME=lo "$python" -m \
      torch.distributed.run --standalone --nproc-per-node $n scripts/gpu/nccl_share_probe.py ||
      shares=0
  done
  nccl_shares=$shares
  figure probe "NCCL, one GPU shared by 2 and 4 ranks with a distinct NCCL_HOSTID each: $([ $shares = 1 ] && echo works || echo refused)"
elif [ -f "$out/nccl_shares" ]; then
  nccl_shares=$(cat "$out/nccl_shares")
fi
echo "$nccl_shares" >"$out/nccl_shares"

build=$(realpath -m "${HP_GPU_BUILD:-$root/build-gpu-check}")
programs_load() {
  "$build/tests/cuda/test_cuda" --gtest_list_tests >/dev/null 2>&1 &&
    "$build/tools/hp_train/hp-train" --help >/dev/null 2>&1 &&
    "$build/tools/hprun/hprun" --help >/dev/null 2>&1
}
built=0
if wanted build || { { wanted tests || wanted train || wanted bench; } && ! programs_load; }; then
  if [ -f "$build/build.ninja" ] || [ ! -e "$build" ]; then
    prefix=/tmp/hp-gpu-deps
    mkdir -p "$prefix"
    for f in "${HP_GPU_DEPS:-.gpu/debs}"/*.deb; do
      [ -f "$f" ] && dpkg -x "$f" "$prefix"
    done
    run_step build 480 bash -c "set -e
      cmake -S . -B '$build' -G Ninja -DCMAKE_BUILD_TYPE=Release \
        '-DCMAKE_PREFIX_PATH=$torch_dir;$prefix/usr' '-DHP_PYTHON=$(command -v "$python")' >/dev/null
      grep -q USE_C10D_NCCL '$build/compile_commands.json' ||
        { echo 'the configure did not define USE_C10D_NCCL: this torch has no NCCL'; exit 1; }
      ninja -C '$build' -j$(nproc) test_cuda hprun hp-train hp-bench" && built=1
  fi
  if [ $built = 0 ] && programs_load; then
    note "$(printf '%-30s %s' build "not a build folder here: using the programs in $build")"
  elif [ $built = 0 ]; then
    note "gpu-check: nothing runnable in $build (logs/build.log); the steps after it cannot run"
    failed=1
    build=""
  fi
fi
[ -n "$build" ] && ! programs_load && build=""
hprun=${build:+$build/tools/hprun/hprun}

if wanted tests; then
  if [ -z "$build" ]; then
    skip tests "no build"
  else
    export OMP_NUM_THREADS=1 HP_TEST_TIMEOUT_S=120
    run_step tests.nccl.n1 150 "$hprun" -n 1 --timeout 140 "$build/tests/cuda/test_cuda"
    for n in 2 4; do
      run_step "tests.gloo.n$n" 200 env HP_CUDA_BACKEND=gloo HP_SHARE_GPUS=1 \
        "$hprun" -n $n --timeout 190 "$build/tests/cuda/test_cuda"
      # NCCL_HOSTID and loopback come from the library (HP_SHARE_GPUS=1).
      if [ "$nccl_shares" = 1 ] || [ "$gpus" -ge $n ]; then
        run_step "tests.nccl.n$n" 200 env HP_SHARE_GPUS=1 \
          "$hprun" -n $n --timeout 190 "$build/tests/cuda/test_cuda"
      else
        skip "tests.nccl.n$n" "NCCL refused ranks sharing a GPU (probe)"
      fi
    done
    for f in "$logs"/tests.*.log; do
      name=$(basename "$f" .log)
      while read -r line; do figure "$name" "$line"; done < <(
        grep -E "\[  (PASSED|FAILED)  \] [0-9]+ test|SKIPPED \] [0-9]+ test|\[  FAILED  \] [A-Za-z]" "$f" |
          sed 's/^\[rank [0-9]*\] //' | sort -u)
    done
  fi
fi

if wanted train; then
  if [ -z "$build" ]; then
    skip train "no build"
  else
    bash scripts/gpu/train-check.sh "$build" "$hprun" "$logs" "$out/train.tsv" "$python"
    while IFS=$'\t' read -r name verdict took figures; do
      note "$(printf '%-30s %-22s %4ds' "$name" "$verdict" "$took")"
      printf '%s\t%s\t%s\t\n' "$name" "$verdict" "$took" >>"$records"
      [ "$verdict" = ok ] || failed=1
      [ -n "$figures" ] && figure "$name" "$figures"
    done <"$out/train.tsv"
  fi
fi

if wanted bench; then
  if [ -z "$build" ]; then
    skip bench "no build"
  elif ! "$build/bench/hp-bench" --help 2>&1 | grep -q -- "--device"; then
    skip bench "this build's hp-bench has no --device option"
  else
    mkdir -p "$out/bench"
    bench=("$build/bench/hp-bench" --device cuda --hprun "$hprun" --python "$python"
           --torch-script "$root/bench/torch_ddp_baseline.py" --plot-script "$root/bench/plot_bench.py")
    # A world of one, where one GPU gives real figures: fully_shard against
    # the model without it (fp32 on both), and ours against FSDP2 in fp32
    # and in the GPU recipe (bf16 parameters, fp32 reduction).
    run_step bench.ws1.fp32 240 "${bench[@]}" --ranks 1 --param-dtype fp32 --reduce-dtype fp32 \
      --rows single,fsdp_fused_prefetch,torch_single,torch_fsdp2 --steps 10 --rounds 1 \
      --json "$out/bench/ws1-fp32.json" --png "$out/bench/ws1-fp32.png"
    run_step bench.ws1.bf16 180 "${bench[@]}" --ranks 1 --rows fsdp_fused_prefetch,torch_fsdp2 \
      --steps 10 --rounds 1 --json "$out/bench/ws1-bf16.json"
    # Every GPU row on ranks sharing the GPU: that each runs and reports;
    # its times are the shared GPU's, not a comparison.
    run_step bench.shared.n2 240 env HP_SHARE_GPUS=1 "${bench[@]}" --ranks 2 --hsdp-ranks 4 \
      --steps 5 --warmup 2 --rounds 1 --json "$out/bench/shared-n2.json"
    for f in "$logs"/bench.*.log; do
      name=$(basename "$f" .log)
      while read -r line; do figure "$name" "$line"; done < <(
        sed -n '/^row /,/^$/p; /^targets:/,/^$/p' "$f" | grep -v '^$')
    done
  fi
fi

"$python" - "$records" "$out/summary.json" "$card" "$commit" <<'EOF'
import json, sys
records, path, card, commit = sys.argv[1:5]
steps = {}
for line in open(records):
    name, verdict, seconds, text = (line.rstrip("\n").split("\t") + ["", "", ""])[:4]
    step = steps.setdefault(name, {"step": name, "figures": []})
    if verdict:
        step["result"] = verdict
        step["seconds"] = int(seconds or 0)
    if text:
        step["figures"].append(text)
json.dump({"card": card, "commit": commit, "steps": list(steps.values())}, open(path, "w"), indent=1)
EOF
tar -czf "$out/logs.tar.gz" -C "$out" logs
echo "gpu-check: summary in $summary and $out/summary.json, logs in $out/logs.tar.gz"
exit $failed
