// A shared-memory channel: the bulk collectives of one group whose members
// all run on this host, moved through a memory segment they all map instead
// of through Gloo's sockets.
//
// Why: on one host a Gloo collective copies every byte into the kernel and
// out again and wakes a thread per message; here a byte is copied into the
// segment once and read out by the peers, and ranks meet at a futex. The
// collectives facade (collectives.h) sends all-gathers, reduce-scatters and
// all-reduces of CPU tensors here when the group has a channel; everything
// else stays on Gloo, and a group gets no channel where any member cannot
// map the segment (another host, another /dev/shm, no room there, HP_SHM=0).
//
// Ordering: every member submits the same operations in the same order (as
// for any collective). Operations run one at a time, in submission order, on
// the channel's own thread; Gloo's operations on the same group run on
// Gloo's threads, independently, which is safe because each side keeps its
// own order.
//
// Threads: submit() may be called from any thread. `done` runs on the
// channel's thread, once per operation.
//
// Errors: a peer that does not arrive within the timeout, whose process
// exited, or whose channel failed makes the operation fail with an
// exception naming that group rank. After any failure the channel is
// unusable: the segment's state no longer matches across ranks, so every
// later operation fails at once, saying why (and the peers' fail too).
//
// Ownership: the segment has a name (/dev/shm/hp-shm-<pid namespace>-<pid
// of rank 0>-<random token>) only while connect() runs: rank 0 unlinks it
// as soon as every member has mapped it or given up, and on every error
// path (a store that times out, a peer that never answers), so it then
// disappears with the last process, however that process ends. A rank 0
// killed inside that window leaves the name behind: every connect() first
// unlinks the hp-shm segments of this user whose creator (in this pid
// namespace) no longer runs.
//
// Trust: a peer maps the segment the store names only when it is this
// user's (owner == the effective uid) and open to no one else (mode 0600);
// otherwise it refuses, naming the segment, its owner and mode, and the
// group goes without a channel (rank 0 prints why).
#pragma once

#include <chrono>
#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "hp/distributed/reduce_op.h"

namespace c10d {
class Store;
}

namespace hp::dist {

class ShmChannel {
 public:
  enum class Kind { kAllGather, kAllGatherCoalesced, kReduceScatter, kAllReduce };

  // One collective. Tensors are contiguous CPU tensors of one dtype, the
  // same sizes on every rank:
  //   kAllGather:     output[r*n:(r+1)*n] = input of rank r (n = input.numel())
  //   kReduceScatter: output = reduce over r of input[me*n:(me+1)*n] of rank r
  //                   (n = output.numel())
  //   kAllReduce:     input = reduce over r of input of rank r (output unused)
  //   kAllGatherCoalesced: outputs[r][i] = inputs[i] of rank r (input and
  //                   output unused; every tensor contiguous, inputs[i] and
  //                   outputs[r][i] of the same size)
  // `reduce` is kSum, kMax or kMin (an average is a sum the caller divides).
  // Every rank gets the same bits: each element is reduced once, by one
  // rank, in group-rank order.
  struct Op {
    Kind kind = Kind::kAllGather;
    at::Tensor input;
    at::Tensor output;
    ReduceOp reduce = ReduceOp::kSum;
    std::vector<at::Tensor> inputs;
    std::vector<std::vector<at::Tensor>> outputs;
  };

  // Collective over `store` (the group's own prefix store): every member of
  // the group calls it with its group rank. Returns a channel on every rank
  // or, when any member cannot map the segment, nullptr on every rank.
  // `description` names the group in error messages.
  static std::unique_ptr<ShmChannel> connect(c10d::Store& store, int rank, int size,
                                             std::chrono::milliseconds timeout,
                                             const std::string& description);

  // Whether a channel can carry this tensor's operation: a CPU tensor.
  static bool carries(const at::Tensor& t) { return t.defined() && t.is_cpu(); }

  // Finishes the running operation (or lets it time out); operations still
  // queued fail with an error that says the group was destroyed.
  ~ShmChannel();
  ShmChannel(const ShmChannel&) = delete;
  ShmChannel& operator=(const ShmChannel&) = delete;

  // Queues `op`; `done` receives nullptr or the failure.
  void submit(Op op, std::function<void(std::exception_ptr)> done);

  class Impl;

 private:
  explicit ShmChannel(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace hp::dist
