#!/usr/bin/env bash
# Two "nodes" on loopback: two hprun invocations with --nnodes 2 form one
# world of 4 ranks (node 1 holds global ranks 2 and 3).
# Usage: two_nodes.sh HPRUN PROGRAM
set -euo pipefail
hprun=$1
prog=$2
port=$(/usr/bin/python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
common=(--nnodes 2 --master-addr 127.0.0.1 --master-port "$port")
"$hprun" -n 2 "${common[@]}" --node-rank 0 "$prog" sum >"$out/node0" 2>&1 &
node0=$!
"$hprun" -n 2 "${common[@]}" --node-rank 1 "$prog" sum >"$out/node1" 2>&1 || status1=$?
wait "$node0" || status0=$?
cat "$out/node0" "$out/node1"
[ "${status0:-0}" = 0 ] && [ "${status1:-0}" = 0 ] || { echo "a node failed"; exit 1; }
for r in 0 1 2 3; do
  grep -q "^\[rank $r\] rank $r of 4 (local rank $((r % 2))): all_reduce sum 6" "$out"/node* \
    || { echo "rank $r did not report the expected sum"; exit 1; }
done
echo "two nodes: 4 ranks agree"
