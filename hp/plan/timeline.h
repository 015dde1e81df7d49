// The memory plan's timeline (P2, hp/plan/memory_plan.h): the tensors one
// simulated step holds, by term, and the highest total seen with what made
// it up. Internal to hp/plan; single-threaded, nothing allocated for real.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "hp/plan/memory_plan.h"

namespace hp::plan::detail {

// The live tensors of one simulated step, by term, and the highest total
// seen with what made it up.
class Timeline {
 public:
  using Id = int64_t;
  static constexpr Id kNone = -1;

  Id alloc(Term term, int64_t bytes) {
    if (bytes <= 0) return kNone;
    const Id id = next_++;
    blocks_[id] = {term, bytes};
    live_.bytes[static_cast<int>(term)] += bytes;
    const int64_t total = live_.total();
    if (total > peak_.terms.total()) peak_ = {live_, where_, in_flight_};
    activations_high_ =
        std::max(activations_high_, live_[Term::kActivations] + live_[Term::kCommunication]);
    return id;
  }
  void free(Id& id) {
    if (id == kNone) return;
    auto it = blocks_.find(id);
    if (it != blocks_.end()) {
      live_.bytes[static_cast<int>(it->second.first)] -= it->second.second;
      if (in_flight_ids_.erase(id)) in_flight_ -= it->second.second;
      blocks_.erase(it);
    }
    id = kNone;
  }
  // Memory that only a collective in flight holds: freed when the backend
  // completes it, which may be before the code waits for it.
  void mark_in_flight(Id id) {
    if (id == kNone || !in_flight_ids_.insert(id).second) return;
    in_flight_ += blocks_.at(id).second;
  }
  void free_all(std::vector<Id>& ids) {
    for (Id& id : ids) free(id);
    ids.clear();
  }
  // A tensor that exists only for the duration of one kernel.
  void spike(Term term, int64_t bytes) {
    Id id = alloc(term, bytes);
    free(id);
  }
  // The same memory, counted under another term from now on.
  void retag(Id id, Term term) {
    if (id == kNone) return;
    auto& block = blocks_.at(id);
    live_.bytes[static_cast<int>(block.first)] -= block.second;
    block.first = term;
    live_.bytes[static_cast<int>(term)] += block.second;
  }
  void at(std::string where) { where_ = std::move(where); }
  // The step starts: what is live now is the baseline of its peak.
  void start_peak() { peak_ = {live_, where_, in_flight_}; }
  // The activations' own high-water mark since start_activations_phase():
  // how far one part of the step (a block's forward, its backward) rises
  // above what was live when it began (hp/plan/pipeline_plan.cpp). It
  // counts the communication term too: a step without fully_shard holds
  // there only tensor parallelism's transient all-reduce buffers, which
  // add to a part's rise as they add to the plain plan's peak.
  void start_activations_phase() {
    activations_high_ = live_[Term::kActivations] + live_[Term::kCommunication];
  }
  int64_t activations_high() const { return activations_high_; }
  int64_t live_activations() const { return live_[Term::kActivations]; }
  const StepPeak& peak() const { return peak_; }
  int64_t live_total() const { return live_.total(); }

 private:
  std::unordered_map<Id, std::pair<Term, int64_t>> blocks_;
  Id next_ = 0;
  Breakdown live_;
  std::unordered_set<Id> in_flight_ids_;
  int64_t in_flight_ = 0;
  StepPeak peak_;
  int64_t activations_high_ = 0;
  std::string where_ = "start of the step";
};
using Id = Timeline::Id;

}  // namespace hp::plan::detail
