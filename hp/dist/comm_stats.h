// Counters of this process's collectives, for benchmarks (A2).
//
// Every collective issued through the facade is counted by kind; its time
// from issue to completion (as the backend reports it) is summed into
// comm_seconds, and the time callers spent blocked in Work::wait() into
// wait_seconds. wait_seconds / comm_seconds is the exposed fraction of the
// communication: the part that compute did not hide.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>

#include "hp/dist/op_type.h"

namespace hp::dist {

struct CommStats {
  std::array<int64_t, kOpTypeCount> calls{};  // indexed by OpType
  double comm_seconds = 0;
  double wait_seconds = 0;

  int64_t operator[](OpType op) const { return calls[static_cast<size_t>(op)]; }
  int64_t& operator[](OpType op) { return calls[static_cast<size_t>(op)]; }
  int64_t total() const;
  // "all_gather 1, reduce_scatter 0, ..., barrier 0": every kind, for messages.
  std::string describe_calls() const;
};

// The calls (and seconds) of `later` since `earlier`.
CommStats operator-(const CommStats& later, const CommStats& earlier);

CommStats comm_stats();
void reset_comm_stats();

}  // namespace hp::dist
