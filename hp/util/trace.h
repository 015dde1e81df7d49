// A process-wide timeline in Chrome's trace-event format (A3).
//
// When enabled, the layers record spans: each unit's forward and backward
// compute, each collective from issue to completion, and the time spent
// blocked waiting for one. write() produces JSON that Perfetto
// (ui.perfetto.dev) and chrome://tracing open; one file per rank, with the
// rank as the process id. Disabled (the default), recording costs one
// relaxed atomic load.
//
// These spans are host times. On a GPU the layers also record what the
// device ran, timed on its streams, in lanes of their own ("gpu compute",
// "gpu all_gather", ...): gpu_trace.h.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

namespace hp::trace {

struct Event {
  std::string name;
  std::string category;  // "compute", "comm", "wait", "step"
  std::string lane;      // one row in the viewer, e.g. "compute", "all_gather"
  int64_t start_us;
  int64_t end_us;
};

bool enabled();
// Starts recording (clears earlier events); `pid` labels this process.
void enable(int pid, const std::string& process_name);
void disable();

// Microseconds since the origin: the process's start until set_origin().
int64_t now_us();

// Makes now_us() count from `unix_us`, an instant on the wall clock
// (microseconds since the Unix epoch), from now on; the timestamps stay
// monotonic (steady clock), only their zero moves. Ranks that set the same
// instant (rank 0's reading, broadcast) share one time base, so their traces
// line up in a viewer: on one host exactly, across hosts as well as their
// clocks agree. write() records the instant as otherData.origin_unix_us.
void set_origin(int64_t unix_us);

// The wall clock now, in microseconds since the Unix epoch.
int64_t unix_now_us();

void record(std::string name, std::string category, std::string lane, int64_t start_us,
            int64_t end_us);

// Records [construction, destruction) when tracing is enabled.
class Span {
 public:
  Span(std::string name, const char* category, const char* lane);
  // Named `prefix` + `subject`, the name built only when tracing is on: for
  // spans on a hot path (every unit, every step), which must not allocate
  // when nobody records them.
  Span(const char* prefix, const std::string& subject, const char* category, const char* lane);
  ~Span();
  Span(const Span&) = delete;
  Span& operator=(const Span&) = delete;

 private:
  bool active_;
  std::string name_;
  const char* category_;
  const char* lane_;
  int64_t start_;
};

std::vector<Event> events();
// Writes the recorded events as Chrome trace JSON; raises on I/O errors.
// First waits for the GPU spans still pending (gpu_trace.h) and adds them.
void write(const std::string& path);

}  // namespace hp::trace
