// Counts the collectives this process issues over a stretch of a test, so a
// test can check that an operation communicates the way its name claims (a
// value check alone passes just as well with extra or different collectives).
// Takes differences of dist::comm_stats() rather than resetting it.
#pragma once

#include "hp/dist/comm_stats.h"

namespace hp::test {

class CommCounter {
 public:
  CommCounter() : start_(dist::comm_stats()) {}

  // Collectives issued since construction (or the last restart()).
  dist::CommStats delta() const {
    const dist::CommStats now = dist::comm_stats();
    dist::CommStats d;
    d.all_gather = now.all_gather - start_.all_gather;
    d.reduce_scatter = now.reduce_scatter - start_.reduce_scatter;
    d.all_reduce = now.all_reduce - start_.all_reduce;
    d.broadcast = now.broadcast - start_.broadcast;
    d.all_to_all = now.all_to_all - start_.all_to_all;
    d.barrier = now.barrier - start_.barrier;
    return d;
  }
  void restart() { start_ = dist::comm_stats(); }

 private:
  dist::CommStats start_;
};

}  // namespace hp::test
