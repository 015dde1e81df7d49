// Cross-rank verification of collective calls (debug mode).
//
// Gloo aborts the whole process (SIGABRT) when ranks pass different sizes to
// one collective, and two ranks that issue collectives in a different order
// deadlock. With checks on, every collective first all-gathers a small
// fingerprint of the call (kind, sequence number, sizes, dtype, op) and
// compares it across the group, so such a bug becomes a CollectiveError on
// every rank that names each rank's call. It costs one extra small
// all-gather per collective, so it is off unless HP_CHECK_COLLECTIVES=1 or
// set_collective_checks(true); all ranks of a job must agree on it.
#pragma once

#include <cstdint>

#include "hp/distributed/group.h"
#include "hp/distributed/op_type.h"

namespace hp::dist {

struct CallFingerprint {
  OpType op;
  uint64_t sequence;
  int64_t input_numel;
  int64_t output_numel;
  int64_t dtype;
  int64_t extra = 0;  // reduce op, broadcast source
};

bool collective_checks_enabled();
void set_collective_checks(bool enabled);

// Raises CollectiveError on every rank if the group's fingerprints differ.
void verify_same_call(Group& group, const CallFingerprint& mine);

}  // namespace hp::dist
