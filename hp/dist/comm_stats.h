// Counters of this process's collectives, for benchmarks (A2).
//
// Every collective issued through the facade is counted by kind; its time
// from issue to completion (as the backend reports it) is summed into
// comm_seconds, and the time callers spent blocked in Work::wait() into
// wait_seconds. wait_seconds / comm_seconds is the exposed fraction of the
// communication: the part that compute did not hide.
#pragma once

#include <cstdint>

namespace hp::dist {

struct CommStats {
  int64_t all_gather = 0;
  int64_t reduce_scatter = 0;
  int64_t all_reduce = 0;
  int64_t broadcast = 0;
  int64_t all_to_all = 0;
  int64_t barrier = 0;
  double comm_seconds = 0;
  double wait_seconds = 0;

  int64_t total() const {
    return all_gather + reduce_scatter + all_reduce + broadcast + all_to_all + barrier;
  }
};

CommStats comm_stats();
void reset_comm_stats();

}  // namespace hp::dist
