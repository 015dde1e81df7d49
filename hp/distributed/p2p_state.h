// What a Group keeps for its point-to-point ops (p2p.h): how many sends and
// receives it issued to and from each peer, and, with the p2p checks on,
// the order in which checked receives post their payloads. Internal to
// hp/distributed; owned by the Group (created with it, for every group
// rank). Threads: any; one mutex, held only to read or swap a field.
#pragma once

#include <cstdint>
#include <future>
#include <map>
#include <mutex>
#include <utility>
#include <vector>

namespace hp::dist {

class P2PState {
 public:
  explicit P2PState(int size) : counts_(2 * static_cast<size_t>(size), 0) {}

  // Claims the next number of this rank's sends to (`send`) or receives
  // from group rank `peer`: the k-th send from A to B pairs with B's k-th
  // receive from A, so both ends report the same number for one transfer.
  uint64_t next(int peer, bool send) {
    std::lock_guard<std::mutex> lock(mutex_);
    return counts_[index(peer, send)]++;
  }
  uint64_t count(int peer, bool send) const {
    std::lock_guard<std::mutex> lock(mutex_);
    return counts_[index(peer, send)];
  }

  // A checked receive posts its payload from a thread of its own, after
  // its header arrived; receives from one peer with one tag must still post
  // in the order they were issued (the transport pairs them in posting
  // order). Each hands in the signal it gives once it posted and gets the
  // previous one's, to wait for first (invalid for the first).
  std::shared_future<void> exchange_posted(int peer, int tag, std::shared_future<void> mine) {
    std::lock_guard<std::mutex> lock(mutex_);
    std::shared_future<void>& slot = posted_[{peer, tag}];
    std::swap(slot, mine);
    return mine;
  }

 private:
  static size_t index(int peer, bool send) {
    return 2 * static_cast<size_t>(peer) + (send ? 0 : 1);
  }

  mutable std::mutex mutex_;
  std::vector<uint64_t> counts_;
  std::map<std::pair<int, int>, std::shared_future<void>> posted_;
};

}  // namespace hp::dist
