#!/usr/bin/env bash
# Two ranks on one host that do not share /dev/shm (rank 1 in its own mount
# namespace, as in another container): the group must fall back to Gloo,
# give the right sums, and say once why it has no shared memory.
# Usage: separate_shm.sh PROGRAM   (failure_scenarios)
# Needs root and unshare: exits 77 (skipped) without them.
set -uo pipefail
prog=$1
if [ "$(id -u)" != 0 ] || ! unshare --mount true 2>/dev/null; then
  echo "skipped: a private /dev/shm needs root and unshare --mount"
  exit 77
fi
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
export MASTER_ADDR=127.0.0.1 MASTER_PORT=$port WORLD_SIZE=2 LOCAL_WORLD_SIZE=2 HP_TIMEOUT_S=30
RANK=0 LOCAL_RANK=0 "$prog" sum >"$out/0" 2>&1 &
rank0=$!
RANK=1 LOCAL_RANK=1 unshare --mount sh -c 'mount -t tmpfs tmpfs /dev/shm && exec "$0" sum' \
  "$prog" >"$out/1" 2>&1 &
rank1=$!
wait "$rank0"; status0=$?
wait "$rank1"; status1=$?
cat "$out/0" "$out/1"
if [ "$status0" != 0 ] || [ "$status1" != 0 ]; then
  echo "FAIL: ranks exited $status0 and $status1"
  exit 1
fi
for r in 0 1; do
  if ! grep -q "all_reduce sum 1" "$out/$r"; then
    echo "FAIL: rank $r did not report the sum"
    exit 1
  fi
done
if ! grep -q "group 'world' ranks \[0, 1\] moves its collectives through Gloo only, without shared memory; group rank 1: shm_open" "$out/0"; then
  echo "FAIL: rank 0 did not say why the group has no shared memory"
  exit 1
fi
echo "the group fell back to Gloo and said why"
