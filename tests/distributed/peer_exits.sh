#!/usr/bin/env bash
# A peer that exits while the others wait for it in the shared-memory
# channel, with no launcher to end the job: the survivor must fail soon,
# naming the rank that exited, not wait out its timeout. Two ranks started
# by hand (torchrun's variables), rank 1 exiting right after init. (Under
# hprun the survivor would be terminated as soon as the peer died, before
# its own message.)
# Usage: peer_exits.sh PROGRAM [MODE PATTERN]   (failure_scenarios)
#   MODE     failure_scenarios' mode (default die: an all-reduce in the channel)
#   PATTERN  what rank 0's message must match (grep -E)
set -uo pipefail
prog=$1
mode=${2:-die}
pattern=${3:-"group rank 1 \(pid [0-9]*\) exited while this rank waited"}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
export MASTER_ADDR=127.0.0.1 MASTER_PORT=$port WORLD_SIZE=2 LOCAL_WORLD_SIZE=2
# A timeout far beyond the test's limit: only noticing the exit passes.
export HP_TIMEOUT_S=300
RANK=0 LOCAL_RANK=0 "$prog" "$mode" >"$out/0" 2>&1 &
survivor=$!
RANK=1 LOCAL_RANK=1 "$prog" "$mode" >"$out/1" 2>&1 &
start=$SECONDS
wait "$survivor"
status=$?
elapsed=$((SECONDS - start))
wait
cat "$out/0"
if [ "$status" = 0 ]; then
  echo "FAIL: rank 0 exited 0 although rank 1 died"
  exit 1
fi
if ! grep -Eq "$pattern" "$out/0"; then
  echo "FAIL: rank 0's error does not name the rank that exited"
  exit 1
fi
echo "rank 0 failed with status $status after ${elapsed} s, naming the rank that exited"
