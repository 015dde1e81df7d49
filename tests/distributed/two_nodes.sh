#!/usr/bin/env bash
# Two "nodes": two hprun invocations with --nnodes 2 form one world of 4 ranks
# (node 1 holds global ranks 2 and 3); node 0's agent picks the ranks' port.
# Usage: two_nodes.sh HPRUN PROGRAM [--netns]
#   default   both nodes on loopback
#   --netns   each node in its own network namespace, joined by a veth pair
#             (as two hosts); attempt 0 loses rank 3 before it meets the
#             others, so the sums come from the restart (--max-restarts 1).
#             Needs root and iproute2: exits 77 (skipped) without them.
set -euo pipefail
hprun=$1
prog=$2
mode=${3:-}
out=$(mktemp -d)
base=hp$$
cleanup() {
  rm -rf "$out"
  if [ "$mode" = --netns ]; then
    ip netns delete "${base}a" 2>/dev/null || true
    ip netns delete "${base}b" 2>/dev/null || true
    ip link delete "${base}v" 2>/dev/null || true
  fi
}
trap cleanup EXIT

node_cmd=()  # per node: what runs hprun
if [ "$mode" = --netns ]; then
  if [ "$(id -u)" != 0 ] || ! command -v ip >/dev/null; then
    echo "skipped: network namespaces need root and iproute2"
    exit 77
  fi
  ip netns add "${base}a"
  ip netns add "${base}b"
  ip link add "${base}v" type veth peer name "${base}w"
  ip link set "${base}v" netns "${base}a"
  ip link set "${base}w" netns "${base}b"
  ip -n "${base}a" addr add 10.213.2.1/24 dev "${base}v"
  ip -n "${base}b" addr add 10.213.2.2/24 dev "${base}w"
  for ns in a b; do ip -n "${base}$ns" link set lo up; done
  ip -n "${base}a" link set "${base}v" up
  ip -n "${base}b" link set "${base}w" up
  addr=10.213.2.1
  port=29400  # every port is free in a fresh namespace
  node_cmd[0]="ip netns exec ${base}a env GLOO_SOCKET_IFNAME=${base}v"
  node_cmd[1]="ip netns exec ${base}b env GLOO_SOCKET_IFNAME=${base}w"
  extra=(--max-restarts 1 --rdzv-timeout 30)
  # Rank 3 fails in attempt 0 only, before joining the others.
  rank_cmd=(sh -c 'if [ "$TORCHELASTIC_RESTART_COUNT" = 0 ] && [ "$RANK" = 3 ]; then exit 7; fi
                   exec "$0" sum' "$prog")
else
  addr=127.0.0.1
  port=$(/usr/bin/python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  node_cmd[0]=""
  node_cmd[1]=""
  extra=()
  rank_cmd=("$prog" sum)
fi

common=(--nnodes 2 --master-addr "$addr" --master-port "$port" "${extra[@]}")
# The agents authenticate each other with a secret every node shares (the
# README's "Several nodes"); node 0 listens where the other node reaches it.
HPRUN_RDZV_SECRET=$(head -c 32 /dev/urandom | base64)
export HPRUN_RDZV_SECRET
# shellcheck disable=SC2086  # node_cmd is a command prefix, split on purpose
${node_cmd[0]} "$hprun" -n 2 "${common[@]}" --rdzv-bind "$addr" --node-rank 0 "${rank_cmd[@]}" \
  >"$out/node0" 2>&1 &
node0=$!
# shellcheck disable=SC2086
${node_cmd[1]} "$hprun" -n 2 "${common[@]}" --node-rank 1 "${rank_cmd[@]}" >"$out/node1" 2>&1 \
  || status1=$?
wait "$node0" || status0=$?
cat "$out/node0" "$out/node1"
[ "${status0:-0}" = 0 ] && [ "${status1:-0}" = 0 ] || { echo "a node failed"; exit 1; }
for r in 0 1 2 3; do
  grep -q "^\[rank $r\] rank $r of 4 (local rank $((r % 2))): all_reduce sum 6" "$out"/node* \
    || { echo "rank $r did not report the expected sum"; exit 1; }
done
if [ "$mode" = --netns ]; then
  for n in 0 1; do
    grep -Eq "^hprun: restart 1/1: rank 3 \(pid [0-9]+\) exited with status 7 on node 1 at" \
      "$out/node$n" || { echo "node $n did not report the restart"; exit 1; }
  done
fi
echo "two nodes: 4 ranks agree"
