// Point-to-point transfers between the ranks of a pipeline
// (docs/pipeline.md): what the pipeline executor sends activations and
// their gradients through.
//
// Peers are pipeline ranks (0 .. size()-1). Transfers between two ranks
// with the same tag arrive in the order they were posted; tags keep the
// activations (kActivationTag) and the gradients (kGradientTag) apart, so
// the two directions never share a queue. send() and recv() return at once;
// the tensor must stay alive and unchanged (send) or untouched (recv) until
// the handle's wait() returned. wait() raises hp::CollectiveError when the
// transfer failed or timed out (a dead or hung neighbour), naming the
// transfer.
//
// GroupTransport runs over a process group's point-to-point
// (hp/distributed/p2p.h); LoopbackTransport connects pipeline ranks that
// are threads of one process (tests, and a pipeline inside one process).
// A transport is used by one thread at a time.
#pragma once

#include <ATen/core/Tensor.h>

#include <chrono>
#include <memory>
#include <vector>

#include "hp/distributed/group.h"

namespace hp::pp {

constexpr int kActivationTag = 0;
constexpr int kGradientTag = 1;
// Once per step, the boundary's shape and dtype each neighbour expects
// (Pipeline::step), apart from both.
constexpr int kHeaderTag = 2;

class TransferHandle {
 public:
  virtual ~TransferHandle() = default;
  virtual void wait() = 0;
};

// One send or receive of a batch (Transport::post).
struct Transfer {
  bool send;          // else a receive
  at::Tensor tensor;  // sent from, or received into
  int peer;
  int tag;
};

class Transport {
 public:
  virtual ~Transport() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual std::unique_ptr<TransferHandle> send(const at::Tensor& tensor, int peer, int tag) = 0;
  virtual std::unique_ptr<TransferHandle> recv(const at::Tensor& tensor, int peer, int tag) = 0;
  // Posts `transfers` together, in order, one handle each (result[i] for
  // transfers[i]), as send() and recv() would post them one by one: the
  // default does just that. GroupTransport coalesces them into one group
  // call where c10d can (NCCL), where waiting for any handle of the batch
  // waits for all of it.
  virtual std::vector<std::unique_ptr<TransferHandle>> post(const std::vector<Transfer>& transfers);
  // The global rank of pipeline rank `peer`, for messages.
  virtual int global_rank(int peer) const { return peer; }
};

// Over `group` (the pipeline dimension's group: pipeline rank = group rank).
class GroupTransport : public Transport {
 public:
  explicit GroupTransport(dist::GroupPtr group);
  int rank() const override;
  int size() const override;
  std::unique_ptr<TransferHandle> send(const at::Tensor& tensor, int peer, int tag) override;
  std::unique_ptr<TransferHandle> recv(const at::Tensor& tensor, int peer, int tag) override;
  // Through hp::dist::batch_p2p: one coalesced call on NCCL, one by one on Gloo.
  std::vector<std::unique_ptr<TransferHandle>> post(
      const std::vector<Transfer>& transfers) override;
  int global_rank(int peer) const override;

 private:
  dist::GroupPtr group_;
};

// `size` pipeline ranks inside one process: make() returns one transport
// per rank, sharing their mailboxes; each is then used by its own thread.
// A send copies the tensor into the mailbox (completing at once), a recv's
// wait() blocks until the matching send arrived, at most `timeout`.
class LoopbackTransport : public Transport {
 public:
  static std::vector<std::shared_ptr<LoopbackTransport>> make(
      int size, std::chrono::milliseconds timeout = std::chrono::seconds(60));

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::unique_ptr<TransferHandle> send(const at::Tensor& tensor, int peer, int tag) override;
  std::unique_ptr<TransferHandle> recv(const at::Tensor& tensor, int peer, int tag) override;

  struct Mailboxes;

 private:
  LoopbackTransport(int rank, int size, std::shared_ptr<Mailboxes> boxes);
  int rank_;
  int size_;
  std::shared_ptr<Mailboxes> boxes_;
};

}  // namespace hp::pp
