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

#include "hp/distributed/op_type.h"

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
// Zeroes the counters, and drops the stream waits timed so far.
void reset_comm_stats();

// On a GPU the caller's stream, not the host, is what waits for a
// collective. With set_stream_wait_timing(true), every Work::wait() of a
// CUDA collective marks the caller's current stream before it waits and
// after (hp/util/cuda_timer.h); stream_wait_seconds() sums the GPU time
// between each pair of marks since the last reset_comm_stats(): the time
// that stream stood still for communication (its exposed part). It waits
// for the marks (call it between steps) and is 0 while timing is off and
// on the CPU. Turning it on for a CUDA collective on a libtorch without
// event timing (before 2.11) raises ArgumentError at the first wait.
// Turning timing off folds the marks in too: no CUDA event is left for
// static destruction (a CUDA driver shutting down with the process then
// fails to destroy it, and the process aborts). Threads: any; the marks are
// kept under a mutex.
void set_stream_wait_timing(bool on);
double stream_wait_seconds();

}  // namespace hp::dist
