// A process group: an ordered set of global ranks that run collectives
// together, backed by one c10d ProcessGroupGloo (or NCCL group), plus a
// shared-memory channel for its bulk CPU collectives when all its members
// run on this host (shm_channel.h).
//
// Groups are made by hp::dist::world_group() and hp::dist::new_group(); a
// process that is not in `ranks()` holds a non-member Group whose
// collectives raise ArgumentError. Every collective issued on a member
// increments the group's sequence number, which error messages report so
// that a desynchronised job can be diagnosed (ranks that disagree on the
// sequence number issued collectives in a different order). Point-to-point
// ops (p2p.h) do not touch it: they are numbered per peer and direction in
// the group's P2PState instead.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <c10/core/Device.h>

#include "hp/util/format.h"

namespace c10d {
class ProcessGroup;
}

namespace hp::dist {

class ShmChannel;
class P2PState;

// The c10d backend a group runs on (c10d's ProcessGroup::BackendType): Gloo
// (CPU tensors, and CUDA tensors through host copies on a CUDA build) or
// NCCL (CUDA tensors only).
enum class BackendType { kGloo, kNccl };
// The vector overloads of hp::to_string stay visible next to ours.
using hp::to_string;
const char* to_string(BackendType backend);

class Group {
 public:
  // `group_rank` is this process's index in `ranks`, or -1 for a
  // non-member, whose `process_group` is null. `device` is where the group's
  // tensors live: the CPU for Gloo, this rank's GPU for NCCL.
  // `shm` is the group's shared-memory channel, if every member has one.
  Group(std::vector<int> ranks, int group_rank, std::shared_ptr<c10d::ProcessGroup> process_group,
        std::string name, std::chrono::milliseconds timeout, BackendType kind = BackendType::kGloo,
        c10::Device device = c10::Device(c10::DeviceType::CPU),
        std::unique_ptr<ShmChannel> shm = nullptr);
  ~Group();
  Group(const Group&) = delete;
  Group& operator=(const Group&) = delete;

  // Global ranks in group-rank order.
  const std::vector<int>& ranks() const { return ranks_; }
  int size() const { return static_cast<int>(ranks_.size()); }
  // This process's rank within the group, or -1 when it is not a member.
  int rank() const { return rank_; }
  bool is_member() const { return rank_ >= 0; }
  // Global rank of a group rank.
  int global_rank(int group_rank) const { return ranks_.at(group_rank); }
  const std::string& name() const { return name_; }
  std::chrono::milliseconds timeout() const { return timeout_; }
  BackendType backend_type() const { return kind_; }
  // Where a caller makes the tensors of a collective it issues for values
  // of its own (a count, a flag, a norm): NCCL moves only tensors on its
  // GPU. Data tensors are wherever the data already is (Gloo also moves
  // CUDA tensors).
  c10::Device device() const { return device_; }

  // Collectives issued on this group so far.
  uint64_t sequence_number() const { return sequence_.load(); }
  // Claims the next sequence number (the collectives facade calls this).
  uint64_t next_sequence_number() { return sequence_.fetch_add(1); }

  // "group 'world' ranks [0, 1, 2]"; built once, as every collective's
  // Work keeps it for a possible failure message.
  const std::string& describe() const { return *description_; }
  // The same text, shared, for a Work that may outlive the group.
  const std::shared_ptr<const std::string>& shared_description() const { return description_; }

  // The c10d process group, for code that needs the raw backend (benchmarks
  // comparing against it). Raises ArgumentError on a non-member.
  c10d::ProcessGroup& process_group() const;

  // The channel the collectives facade sends bulk CPU collectives through,
  // or null (a member elsewhere, HP_SHM=0, a group of one, a non-member).
  ShmChannel* shm_channel() const { return shm_.get(); }

  // The per-peer numbers of point-to-point ops (p2p.h and p2p_state.h),
  // which p2p.cpp updates.
  P2PState& p2p_state() const { return *p2p_; }

 private:
  std::vector<int> ranks_;
  int rank_ = -1;
  std::shared_ptr<c10d::ProcessGroup> process_group_;
  std::string name_;
  std::chrono::milliseconds timeout_;
  BackendType kind_;
  c10::Device device_;
  std::shared_ptr<const std::string> description_;
  std::atomic<uint64_t> sequence_{0};
  // Destroyed before the process group: its thread may still be finishing a
  // collective whose completion refers to nothing of Gloo's.
  std::unique_ptr<ShmChannel> shm_;
  std::unique_ptr<P2PState> p2p_;
};

using GroupPtr = std::shared_ptr<Group>;

}  // namespace hp::dist
