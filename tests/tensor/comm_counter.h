// Counts the collectives this process issues over a stretch of a test, so a
// test can check that an operation communicates the way its name claims (a
// value check alone passes just as well with extra or different collectives).
// Takes differences of dist::comm_stats() rather than resetting it.
#pragma once

#include "hp/distributed/comm_stats.h"

namespace hp::test {

class CommCounter {
 public:
  CommCounter() : start_(dist::comm_stats()) {}

  // Collectives issued since construction (or the last restart()).
  dist::CommStats delta() const { return dist::comm_stats() - start_; }
  void restart() { start_ = dist::comm_stats(); }

 private:
  dist::CommStats start_;
};

}  // namespace hp::test
