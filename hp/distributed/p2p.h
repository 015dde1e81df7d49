// Point-to-point sends and receives on a Group, for pipeline parallelism
// (docs/design.md, "Point-to-point").
//
// Pairing: the k-th send from group rank A to B with tag t meets B's k-th
// receive from A with tag t. Ops of one direction to one peer (and tag)
// therefore arrive in the order they were issued, also within a batch;
// sends and receives do not wait for each other. Tags separate streams of
// transfers on Gloo; NCCL ignores them (one FIFO per peer): put transfers
// that must not share a FIFO on groups of their own (new_group with another
// tag).
//
// Every function checks its arguments locally and raises ArgumentError
// before anything reaches the wire: this rank is a member, the peer is
// another group rank, the tag is in [0, kMaxP2PTag], the tensor is defined,
// dense and contiguous and on the group's device kind (NCCL: a CUDA tensor,
// on this rank's GPU; Gloo: a CPU tensor, or a CUDA tensor, which travels
// through a host copy: Gloo hands the transport a raw pointer). Any dtype:
// the bytes travel. The two ends must agree on the byte count; with
// HP_CHECK_COLLECTIVES=1 (collective_checks.h) they also compare shape,
// dtype and p2p sequence number first (Gloo only; see below).
//
// Point-to-point ops do not advance Group::sequence_number() (ranks issue
// different numbers of them); each rank numbers its sends to and its
// receives from every peer instead (p2p_sequence_number), and a failure
// names that number, which both ends of a transfer share.
//
// Completion (work.h):
//   Gloo  the Work's first wait() blocks the calling thread until the
//         transfer finished, for at most the group's timeout (HP_TIMEOUT_S),
//         and raises CollectiveError on a failure or timeout (a dead or hung
//         peer) naming the op ("send"/"recv"), the group, the peer's global
//         rank, the bytes, the tensor's shape and dtype, the tag and the p2p
//         sequence number. Gloo reports completion to no callback:
//         is_completed() is false until a wait() returned. A timeout breaks
//         the whole Gloo group (every later op on it fails): rebuild it.
//         A received CUDA tensor is filled from its host copy by wait().
//   NCCL  queued on NCCL's stream, which the current stream waits for at
//         issue; the host never blocks; a failure is c10d's watchdog's
//         (docs/streams.md).
// Wait for every Work before reusing or freeing its tensor, and before
// destroying the group.
//
// Checks (HP_CHECK_COLLECTIVES=1, the same on every rank; Gloo): before
// each payload the sender sends a header (p2p sequence number, dtype,
// shape); the receiver compares it with its own tensor, answers with its
// own header, and then receives the payload, or on a mismatch drains it.
// A mismatch raises CollectiveError on both ends, each naming both sides'
// shapes, dtypes and numbers, and the pairing of later transfers stays
// intact. A checked receive posts its answer and payload from a thread of
// its own, so no end waits on the other's program order. NCCL transfers are
// not checked (the host would have to wait for the GPU).
//
// Threads: ops may be issued from any thread, but the order of ops of one
// direction to one peer is the order in which they were issued.
#pragma once

#include <cstdint>
#include <vector>

#include <ATen/core/Tensor.h>

#include "hp/distributed/group.h"
#include "hp/distributed/work.h"

namespace hp::dist {

enum class P2POp { kSend, kRecv };
const char* to_string(P2POp op);  // "send", "recv"

// The largest tag: the checks' headers and answers travel under tags of
// their own above it, derived from the payload's (c10d takes only tags >= 0).
inline constexpr int kMaxP2PTag = (1 << 29) - 1;

struct P2PRequest {
  P2POp op;
  at::Tensor tensor;  // sent from, or received into
  int peer;           // group rank
  int tag = 0;
};

// Sends `tensor` to group rank `peer`. Asynchronous (see above).
Work send(Group& group, const at::Tensor& tensor, int peer, int tag = 0);
// Receives into `tensor` from group rank `peer`. Asynchronous (see above).
Work recv(Group& group, const at::Tensor& tensor, int peer, int tag = 0);

// Issues several sends and receives together, in request order; returns
// one Work per request, result[i] for requests[i]. On NCCL (libtorch 2.11
// and later) they are coalesced into one group call (ncclGroupStart/End
// through c10d's startCoalescing/endCoalescing), and every element is that
// one call's Work: waiting for any waits for all. On Gloo, and on NCCL
// before 2.11, each is issued as send()/recv() would, with a Work of its
// own. Every request is checked before any is issued.
std::vector<Work> batch_p2p(Group& group, const std::vector<P2PRequest>& requests);

// How many sends to (kSend) or receives from (kRecv) group rank `peer`
// this rank issued on `group`: the next one's p2p sequence number.
uint64_t p2p_sequence_number(const Group& group, int peer, P2POp op);

}  // namespace hp::dist
