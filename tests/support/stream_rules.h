// The ordering rules of docs/streams.md, checked on a RecordingStreamOps log.
//
// Happens-before is tracked with a vector clock per stream: an entry on a
// stream is ordered after everything earlier on that stream and after
// everything an event it waited for was recorded after. The rules:
//   release      a buffer is released on the stream it was allocated on,
//                and only once that stream is ordered after every use on
//                the other streams;
//   gather waits the copy-in and all-gather streams wait compute only for
//                the iteration start, a copy-out or a reshard (never at
//                every issue);
//   compute waits compute waits a reduce-scatter or all-reduce event only
//                at the reduce-scatter input cap, at the end of backward and
//                where the caller asks for the gradients (or on a failure);
//   all-reduce   the all-reduce stream waits only the reduce-scatter stream;
//   live         at most two all-gather outputs copied out and not released
//                (the previous unit's is kept until the next one's copy-out
//                is), none left at the end of the log, and at most cap + 1
//                reduce-scatter inputs allocated at once.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "hp/distributed/recording_stream_ops.h"

namespace hp::test {

// One line per broken rule, naming the entry; empty when the log keeps them.
std::vector<std::string> check_stream_rules(
    const std::vector<hp::dist::RecordingStreamOps::Entry>& log, int64_t rs_input_cap = 1);

// What a schedule lets run side by side: the log replayed with every
// collective taking `collective_cost` and every "compute ..." mark (a unit's
// forward or backward kernels, as fully_shard logs them) `compute_cost`
// (units), streams running in parallel subject to their waits.
struct StreamOverlap {
  double makespan = 0;       // end of the last operation
  double compute_busy = 0;   // sum of compute durations
  double comm_busy = 0;      // sum of collective durations
  double comm_hidden = 0;    // collective time during which compute was busy
};
StreamOverlap simulate_overlap(const std::vector<hp::dist::RecordingStreamOps::Entry>& log,
                               double collective_cost = 1.0, double compute_cost = 1.0);

}  // namespace hp::test
