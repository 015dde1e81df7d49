#!/usr/bin/env bash
# gpu-check's train step: hp-train on the GPU in every mode, both models,
# the GPU recipe (bf16 parameters, fp32 reduction), the pipeline (--pp),
# and the paths around a run (meta init onto the GPU, checkpoint, resume,
# export, activation checkpointing, sampling). More ranks than GPUs share them
# (HP_SHARE_GPUS=1): those runs check correctness; their speed says nothing.
#
#   train-check.sh BUILD HPRUN LOGS TSV PYTHON
#
# Writes one line per run to TSV: name, verdict ("ok" or why not), seconds,
# figures (the last progress line's speed, MFU and GPU peak, the loss). The
# corpus is Debian's fortunes, from /usr/share/games/fortunes or from the
# fortunes packages scripts/gpu-deps.sh put beside the header packages.
set -uo pipefail
build=$1 hprun=$2 logs=$3 tsv=$4 python=$5
: >"$tsv"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

fortunes=/usr/share/games/fortunes
if [ ! -d "$fortunes" ]; then
  for f in "${HP_GPU_DEPS:-.gpu/debs}"/fortunes*.deb; do
    [ -f "$f" ] && dpkg -x "$f" "$work/fortunes"
  done
  fortunes=$work/fortunes/usr/share/games/fortunes
fi
# The fortunes' bytes as uint16 tokens (vocab 256): hp-train's --data-file.
tokens=$work/fortunes.u16
"$python" - "$fortunes" "$tokens" <<'EOF' || { printf 'train.corpus\tFAILED (no fortunes in %s)\t0\t\n' "$fortunes" >>"$tsv"; exit 0; }
import os, sys
src, dst = sys.argv[1:3]
data = b"".join(open(os.path.join(src, n), "rb").read() for n in sorted(os.listdir(src))
                if os.path.isfile(os.path.join(src, n)) and not n.endswith((".dat", ".u8")))
assert len(data) > 100000, f"only {len(data)} bytes of fortunes in {src}"
import array
array.array("H", list(data)).tofile(open(dst, "wb"))  # one token per byte
EOF

train=$build/tools/hp_train/hp-train
# The GPU configuration: a GPT of d 1024, 12 layers, 16 heads over 1024
# tokens (152.7M parameters with the byte vocabulary), 8 x 1024 tokens a step.
gpu_model=(--layers 12 --d 1024 --heads 16 --ctx 1024 --seq 1024 --batch 8
           --data-file "$tokens" --vocab 256 --lr 3e-4 --log-every 10 --sample-tokens 0)
recipe=(--param-dtype bf16 --reduce-dtype fp32)

# run NAME RANKS ARGS...: hp-train on RANKS ranks (0: alone), logged to
# logs/train.NAME.log; appends its line to TSV.
run() {
  local name=$1 ranks=$2
  shift 2
  local log=$logs/train.$name.log start=$SECONDS rc verdict=ok
  if [ "$ranks" = 0 ]; then
    timeout -k 5 150 "$train" --device cuda "$@" >"$log" 2>&1
  else
    timeout -k 5 150 env HP_SHARE_GPUS=1 "$hprun" -n "$ranks" --timeout 145 "$train" \
      --device cuda "$@" >"$log" 2>&1
  fi
  rc=$?
  [ $rc -eq 0 ] || verdict="FAILED (exit $rc)"
  [ $rc -eq 124 ] && verdict="timed out"
  # The last progress line's figures and the run's loss.
  local speed loss
  speed=$(grep -E "step +[0-9]+/[0-9]+ \| loss" "$log" | tail -1 |
    sed -E 's/^\[rank 0\] //; s/^step +[0-9]+\/[0-9]+ \| loss [0-9.]+ \| //; s/ \| ETA.*//')
  loss=$(grep -oE "loss [0-9.]+ -> [0-9.]+" "$log" | tail -1)
  printf '%s\t%s\t%s\t%s\n' "train.$name" "$verdict" $((SECONDS - start)) \
    "${speed:+$speed; }${loss:-no loss line}" >>"$tsv"
  return $rc
}

# World size 1: the model without fully_shard against fully_shard (fp32:
# --mode none takes no mixed precision), then the recipe.
run none.fp32 0 --mode none "${gpu_model[@]}" --steps 20
run fsdp.n1.fp32 1 --mode fsdp "${gpu_model[@]}" --steps 20
run fsdp.n1.bf16 1 --mode fsdp "${gpu_model[@]}" "${recipe[@]}" --steps 20 --sample-tokens 64
run fsdp.n1.bf16.ac 1 --mode fsdp "${gpu_model[@]}" "${recipe[@]}" --steps 10 \
  --activation-checkpointing blocks
# Ranks sharing the GPU: every mode, checkpoints and resume, the other model.
ckpt=$work/ckpt
run fsdp.n2.save 2 --mode fsdp "${gpu_model[@]}" "${recipe[@]}" --steps 20 --save-dir "$ckpt" \
  --save-every 10 --export "$work/weights.safetensors"
run fsdp.n2.resume 2 --mode fsdp "${gpu_model[@]}" "${recipe[@]}" --steps 30 --save-dir "$ckpt" \
  --resume auto
run hsdp.n4 4 --mode hsdp --mesh 2x2 "${gpu_model[@]}" "${recipe[@]}" --steps 10
run ddp.n2 2 --mode ddp "${gpu_model[@]}" "${recipe[@]}" --steps 10
run tp.n2 2 --mode tp "${gpu_model[@]}" "${recipe[@]}" --steps 10 --sample-tokens 16
run fsdp_tp.n4 4 --mode fsdp_tp --mesh 2x2 "${gpu_model[@]}" "${recipe[@]}" --steps 10
run llama.fsdp.n2 2 --model llama --kv-heads 4 --mode fsdp "${gpu_model[@]}" "${recipe[@]}" \
  --steps 10
# The pipeline on the GPU: 2 stages over the ranks' point-to-point, 1F1B
# and zero bubble (the backward split in two), in fp32 (whole stages take
# no mixed precision), and each stage fully_shard'ed over 2 data-parallel
# ranks in the recipe.
run pp2.1f1b.n2 2 --pp 2 --microbatches 4 "${gpu_model[@]}" --steps 10
run pp2.zero_bubble.n2 2 --pp 2 --pp-schedule zero-bubble --microbatches 4 "${gpu_model[@]}" \
  --steps 10
run pp2.fsdp.n4 4 --pp 2 --mode fsdp --microbatches 4 "${gpu_model[@]}" "${recipe[@]}" --steps 10
exit 0
