#include "tests/support/stream_rules.h"

#include <algorithm>
#include <array>
#include <map>
#include <set>
#include <sstream>
#include <unordered_map>

namespace hp::test {

using hp::dist::RecordingStreamOps;
using hp::dist::StreamRole;
using Entry = RecordingStreamOps::Entry;
using Kind = RecordingStreamOps::Kind;

namespace {

constexpr int kStreams = hp::dist::kStreamRoleCount;
using Clock = std::array<int64_t, kStreams>;  // per stream: last entry index known to precede

int index_of(StreamRole role) { return static_cast<int>(role); }

void join(Clock& into, const Clock& other) {
  for (int i = 0; i < kStreams; ++i) into[i] = std::max(into[i], other[i]);
}

std::string describe(const std::vector<Entry>& log, size_t i) {
  return RecordingStreamOps::format(log, i, 1);
}

const std::set<std::string>& gather_waits_on_compute() {
  static const std::set<std::string> allowed{"iteration start", "copy out", "reshard"};
  return allowed;
}

const std::set<std::string>& compute_wait_points() {
  static const std::set<std::string> allowed{"reduce-scatter input cap", "end of backward",
                                             "gradients wanted", "pending gradients", "failure",
                                             "tree destroyed"};
  return allowed;
}

}  // namespace

std::vector<std::string> check_stream_rules(const std::vector<Entry>& log, int64_t rs_input_cap) {
  std::vector<std::string> broken;
  std::array<Clock, kStreams> clocks;
  for (auto& c : clocks) c.fill(-1);
  struct EventInfo {
    Clock clock;
    StreamRole stream;
    std::string tag;
  };
  std::unordered_map<uint64_t, EventInfo> events;
  struct Buffer {
    StreamRole stream;
    std::string what;
    std::vector<std::pair<StreamRole, int64_t>> uses;
  };
  std::unordered_map<const void*, Buffer> live;
  std::map<std::string, int64_t> live_count;
  const std::map<std::string, int64_t> live_limit{{"reduce-scatter input", rs_input_cap + 1}};
  int64_t copied_out = 0;  // all-gather outputs read by compute, not yet released
  size_t last_mark = SIZE_MAX;  // index of the last mark
  bool only_waits_since_mark = false;
  for (size_t i = 0; i < log.size(); ++i) {
    const Entry& e = log[i];
    const int s = index_of(e.stream);
    switch (e.kind) {
      case Kind::kRecord:
        clocks[s][s] = static_cast<int64_t>(i);
        events[e.event] = {clocks[s], e.stream, e.tag};
        break;
      case Kind::kWait: {
        auto it = events.find(e.event);
        if (it == events.end()) {
          broken.push_back("waits an event never recorded: " + describe(log, i));
          break;
        }
        const EventInfo& ev = it->second;
        const bool gather_stream =
            e.stream == StreamRole::kCopyIn || e.stream == StreamRole::kAllGather;
        if (gather_stream && ev.stream == StreamRole::kCompute &&
            gather_waits_on_compute().count(ev.tag) == 0) {
          broken.push_back("gather waits: " + std::string(to_string(e.stream)) +
                           " waits compute's '" + ev.tag + "' event: " + describe(log, i));
        }
        const bool reduction_event = ev.stream == StreamRole::kReduceScatter ||
                                     ev.stream == StreamRole::kAllReduce;
        if (e.stream == StreamRole::kCompute && reduction_event) {
          const bool at_point = last_mark != SIZE_MAX && only_waits_since_mark &&
                                compute_wait_points().count(log[last_mark].tag) > 0;
          if (!at_point) {
            broken.push_back("compute waits: compute waits " + std::string(to_string(ev.stream)) +
                             "'s '" + ev.tag + "' event outside the allowed points (last mark: " +
                             (last_mark == SIZE_MAX ? "none" : log[last_mark].tag) +
                             "): " + describe(log, i));
          }
        }
        if (e.stream == StreamRole::kAllReduce && ev.stream != StreamRole::kReduceScatter &&
            ev.stream != StreamRole::kAllReduce) {
          broken.push_back("all-reduce: the all-reduce stream waits " +
                           std::string(to_string(ev.stream)) + "'s '" + ev.tag +
                           "' event: " + describe(log, i));
        }
        join(clocks[s], ev.clock);
        clocks[s][s] = static_cast<int64_t>(i);
        break;
      }
      case Kind::kAlloc: {
        clocks[s][s] = static_cast<int64_t>(i);
        live[e.buffer] = {e.stream, e.tag, {}};
        const int64_t count = ++live_count[e.tag];
        auto limit = live_limit.find(e.tag);
        if (limit != live_limit.end() && count > limit->second) {
          broken.push_back("live: " + std::to_string(count) + " " + e.tag + "s allocated at once (at most " +
                           std::to_string(limit->second) + "): " + describe(log, i));
        }
        break;
      }
      case Kind::kUse: {
        clocks[s][s] = static_cast<int64_t>(i);
        auto it = live.find(e.buffer);
        if (it == live.end()) break;
        if (it->second.what == "all-gather output" && e.stream == StreamRole::kCompute &&
            ++copied_out > 2) {
          // The previous unit's output is kept until this copy-out is, so
          // two meet for a moment; a third is one never released.
          broken.push_back("live: " + std::to_string(copied_out) +
                           " all-gather outputs copied out and not released (at most two: the "
                           "previous unit's until this one is kept): " + describe(log, i));
        }
        it->second.uses.emplace_back(e.stream, static_cast<int64_t>(i));
        break;
      }
      case Kind::kRelease: {
        clocks[s][s] = static_cast<int64_t>(i);
        auto it = live.find(e.buffer);
        if (it == live.end()) break;  // not a tracked allocation
        const Buffer& b = it->second;
        if (b.stream != e.stream) {
          broken.push_back("release: " + b.what + " allocated on " + to_string(b.stream) +
                           " is released on " + to_string(e.stream) + ": " + describe(log, i));
        }
        for (const auto& [stream, at] : b.uses) {
          if (stream == e.stream) continue;
          if (clocks[s][index_of(stream)] < at) {
            broken.push_back("release: " + b.what + " is released on " + to_string(e.stream) +
                             " before it is ordered after its use on " + to_string(stream) +
                             " (entry " + std::to_string(at) + "): " + describe(log, i));
          }
        }
        --live_count[b.what];
        const bool was_copied_out =
            std::any_of(b.uses.begin(), b.uses.end(),
                        [](const auto& use) { return use.first == StreamRole::kCompute; });
        if (b.what == "all-gather output" && was_copied_out) --copied_out;
        live.erase(it);
        break;
      }
      case Kind::kCollective:
      case Kind::kHostWait:
      case Kind::kMark:
        if (e.kind == Kind::kCollective) clocks[s][s] = static_cast<int64_t>(i);
        break;
    }
    if (e.kind == Kind::kMark) {
      last_mark = i;
      only_waits_since_mark = true;
    } else if (e.kind == Kind::kRecord || e.kind == Kind::kCollective ||
               e.kind == Kind::kAlloc || e.kind == Kind::kUse) {
      only_waits_since_mark = false;
    }
  }
  for (const auto& [buffer, b] : live) {
    if (b.what == "all-gather output") {
      broken.push_back("live: an all-gather output allocated on " + std::string(to_string(b.stream)) +
                       " is never released (the root's post-forward and each backward unshard "
                       "release them)");
    }
  }
  return broken;
}

StreamOverlap simulate_overlap(const std::vector<Entry>& log, double collective_cost,
                               double compute_cost) {
  // Each stream runs its entries in order; a wait holds the stream until the
  // event's time. Compute's work is what the "compute ..." marks stand for
  // (each costs compute_cost on the compute stream, where it is logged);
  // collectives take collective_cost on their stream; records take no time.
  std::array<double, kStreams> now{};
  std::unordered_map<uint64_t, double> event_time;
  StreamOverlap result;
  std::vector<std::pair<double, double>> compute_spans, comm_spans;
  const int compute = index_of(StreamRole::kCompute);
  for (const Entry& e : log) {
    const int s = index_of(e.stream);
    switch (e.kind) {
      case Kind::kMark:
        if (e.tag.rfind("compute", 0) == 0) {
          compute_spans.emplace_back(now[compute], now[compute] + compute_cost);
          now[compute] += compute_cost;
          result.compute_busy += compute_cost;
        }
        break;
      case Kind::kRecord:
        event_time[e.event] = now[s];
        break;
      case Kind::kWait: {
        auto it = event_time.find(e.event);
        if (it != event_time.end()) now[s] = std::max(now[s], it->second);
        break;
      }
      case Kind::kCollective:
        comm_spans.emplace_back(now[s], now[s] + collective_cost);
        now[s] += collective_cost;
        result.comm_busy += collective_cost;
        break;
      default: break;
    }
  }
  for (double t : now) result.makespan = std::max(result.makespan, t);
  for (const auto& [c0, c1] : comm_spans) {
    for (const auto& [k0, k1] : compute_spans) {
      result.comm_hidden += std::max(0.0, std::min(c1, k1) - std::max(c0, k0));
    }
  }
  return result;
}

}  // namespace hp::test
