// A per-op CPU profile of this process (A2's --profile-ops): for every op
// libtorch records (aten ops, autograd's backward functions, user scopes),
// its calls, its total time and its self time (the total less the time of
// the ops nested inside it on the same thread).
//
// Built on libtorch's RecordFunction callbacks: start() registers a global
// callback, stop() removes it and returns what it saw. One profile may be
// active per process at a time; a second start() raises ArgumentError.
//
// Threads: ops are counted on every thread that runs them (the caller's,
// the autograd engine's, intra-op workers); each thread adds to its own
// table under its own (uncontended) mutex and stop() merges the tables, so
// a profile costs no shared lock per op. start(), stop() and the destructor
// must not race with each other (call them from one thread); an op still
// running when stop() is called is not counted. Ops of other threads overlap
// the caller's (Gloo records each collective as "gloo:<op>" on its own
// thread, from issue to completion), so self times may add up to more than
// the wall time.
//
// Allocations: with hp::enable_memory_tracking() on, each op also gets the
// number of blocks the CPU allocator handed out on its thread while it ran
// (self: less its nested ops'), and the profile the allocations of the whole
// process; with tracking off, neither is counted.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace hp {

struct OpStats {
  std::string name;  // as libtorch records it: "aten::addmm", "AddmmBackward0", ...
  double calls = 0;  // a count, or a count per step after OpProfileResult::per_step
  double self_us = 0;
  double total_us = 0;
  double self_allocations = 0;  // 0 unless allocations_counted
};

struct OpProfileResult {
  std::vector<OpStats> ops;  // by self time, largest first (ties by name)
  double wall_us = 0;        // from start() to stop()
  bool allocations_counted = false;  // memory tracking was on for the whole profile
  double allocations = 0;    // blocks allocated in the process during it, if counted

  // Every figure divided by `steps` (> 0, else ArgumentError): per-step averages.
  OpProfileResult per_step(int64_t steps) const;

  // {"time_unit": "us", "wall_us": .., "allocations": ..|null, "ops": [{"name", "count",
  // "self_cpu_time", "cpu_time_total", "self_allocations": ..|null}, ...]}: the field
  // names of torch.profiler's key_averages(), so that hp-bench's PyTorch rows write
  // the same schema (bench/torch_baseline_common.py).
  std::string to_json() const;

  // A fixed-width table of the first `max_rows` ops (all when 0).
  std::string table(size_t max_rows = 0) const;
};

class OpProfile {
 public:
  OpProfile() = default;
  ~OpProfile();  // stops an active profile, dropping its result
  OpProfile(const OpProfile&) = delete;
  OpProfile& operator=(const OpProfile&) = delete;

  // Starts counting. ArgumentError when this or another OpProfile of the
  // process is active.
  void start();
  // Stops counting and returns what was counted since start(). ArgumentError
  // when this profile is not active.
  OpProfileResult stop();
  bool active() const { return active_; }

 private:
  bool active_ = false;
};

}  // namespace hp
