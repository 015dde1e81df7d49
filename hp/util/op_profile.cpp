#include "hp/util/op_profile.h"

#include <ATen/record_function.h>
#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <map>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <unordered_map>
#include <unordered_set>
#include <utility>

#include "hp/util/error.h"
#include "hp/util/memory_stats.h"

namespace hp {
namespace {

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// One running op on a thread. RecordFunction is a scope guard, so a thread's
// ops start and end strictly nested: a stack per thread finds the parent.
struct Frame {
  int64_t start_ns;
  int64_t start_allocations;
  int64_t child_ns = 0;
  int64_t child_allocations = 0;
  uint64_t generation;  // the profile it started under (0: none)
};

struct Totals {
  int64_t calls = 0;
  int64_t self_ns = 0;
  int64_t total_ns = 0;
  int64_t self_allocations = 0;
};

// One thread's counts for one profile. Its thread adds to it under `mutex`
// (uncontended but for the one stop() that merges it).
struct ThreadTable {
  explicit ThreadTable(uint64_t g) : generation(g) {}
  const uint64_t generation;
  std::mutex mutex;
  std::unordered_map<std::string, Totals> by_name;
  // Op names are mostly the schema's strings, whose address is stable: the
  // address finds the entry without building a string. Verified by content,
  // since a user scope's name may be freed and its address reused.
  std::unordered_map<const char*, std::pair<const std::string*, Totals*>> by_address;

  static constexpr size_t kMaxAddresses = 4096;

  Totals& entry(const char* name) {
    auto hit = by_address.find(name);
    if (hit != by_address.end() && *hit->second.first == name) return *hit->second.second;
    auto it = by_name.try_emplace(name).first;  // node-based: the pointers stay valid
    // Names built per call (the autograd engine's) may come at ever new
    // addresses: the cache is bounded, the names are not lost.
    if (by_address.size() >= kMaxAddresses) by_address.clear();
    by_address[name] = {&it->first, &it->second};
    return it->second;
  }
};

struct ThreadState {
  std::vector<Frame> stack;
  std::shared_ptr<ThreadTable> table;
};
thread_local ThreadState t_state;

// The active profile (generation 0: none). Generations keep an op that
// started under one profile out of the next.
std::atomic<uint64_t> g_generation{0};

struct Registry {
  std::mutex mutex;
  uint64_t last_generation = 0;
  at::CallbackHandle handle = 0;
  std::vector<std::shared_ptr<ThreadTable>> tables;  // of the active profile
  int64_t start_ns = 0;
  int64_t start_allocations = 0;
  bool tracking_at_start = false;
};

Registry& registry() {
  static auto* r = new Registry();  // never destroyed: callbacks may run at exit
  return *r;
}

ThreadTable& table_of(uint64_t generation) {
  if (!t_state.table || t_state.table->generation != generation) {
    t_state.table = std::make_shared<ThreadTable>(generation);
    Registry& r = registry();
    std::lock_guard<std::mutex> lock(r.mutex);
    // A profile stopped meanwhile never sees this table; it dies with the thread's next one.
    if (g_generation.load(std::memory_order_acquire) == generation) {
      r.tables.push_back(t_state.table);
    }
  }
  return *t_state.table;
}

std::unique_ptr<at::ObserverContext> on_start(const at::RecordFunction& /*fn*/) {
  t_state.stack.push_back(Frame{now_ns(), thread_allocation_count(), 0, 0,
                                g_generation.load(std::memory_order_acquire)});
  return nullptr;
}

void on_end(const at::RecordFunction& fn, at::ObserverContext* /*context*/) {
  // libtorch ends an op with the callbacks it started with, so an end always
  // follows its own start, even after removeCallback.
  if (t_state.stack.empty()) return;
  const Frame frame = t_state.stack.back();
  t_state.stack.pop_back();
  const int64_t total_ns = now_ns() - frame.start_ns;
  const int64_t allocations = thread_allocation_count() - frame.start_allocations;
  if (!t_state.stack.empty()) {
    t_state.stack.back().child_ns += total_ns;
    t_state.stack.back().child_allocations += allocations;
  }
  if (frame.generation == 0 ||
      frame.generation != g_generation.load(std::memory_order_acquire)) {
    return;
  }
  ThreadTable& table = table_of(frame.generation);
  std::lock_guard<std::mutex> lock(table.mutex);
  Totals& t = table.entry(fn.name());
  t.calls += 1;
  t.total_ns += total_ns;
  t.self_ns += total_ns - frame.child_ns;
  t.self_allocations += allocations - frame.child_allocations;
}

int64_t process_allocations() {
  return memory_tracking_enabled() ? memory_stats().allocations : 0;
}

}  // namespace

OpProfile::~OpProfile() {
  if (active_) stop();
}

void OpProfile::start() {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  HP_CHECK_ARG(!active_, "OpProfile::start: this profile is already active; stop() it first");
  HP_CHECK_ARG(g_generation.load(std::memory_order_acquire) == 0,
               "OpProfile::start: another OpProfile of this process is active (generation ",
               g_generation.load(), "); one profile at a time: stop() that one first");
  r.tables.clear();
  r.tracking_at_start = memory_tracking_enabled();
  r.start_allocations = process_allocations();
  r.start_ns = now_ns();
  g_generation.store(++r.last_generation, std::memory_order_release);
  r.handle = at::addGlobalCallback(
      at::RecordFunctionCallback(&on_start, &on_end)
          .scopes({at::RecordScope::FUNCTION, at::RecordScope::BACKWARD_FUNCTION,
                   at::RecordScope::USER_SCOPE}));
  active_ = true;
}

OpProfileResult OpProfile::stop() {
  HP_CHECK_ARG(active_, "OpProfile::stop: this profile is not active; start() it first");
  Registry& r = registry();
  OpProfileResult result;
  std::map<std::string, Totals> merged;
  {
    std::lock_guard<std::mutex> lock(r.mutex);
    g_generation.store(0, std::memory_order_release);
    at::removeCallback(r.handle);
    result.wall_us = static_cast<double>(now_ns() - r.start_ns) / 1e3;
    result.allocations_counted = r.tracking_at_start;
    result.allocations = static_cast<double>(process_allocations() - r.start_allocations);
    for (const auto& table : r.tables) {
      std::lock_guard<std::mutex> table_lock(table->mutex);
      for (const auto& [name, t] : table->by_name) {
        Totals& m = merged[name];
        m.calls += t.calls;
        m.self_ns += t.self_ns;
        m.total_ns += t.total_ns;
        m.self_allocations += t.self_allocations;
      }
    }
    r.tables.clear();
    active_ = false;
  }
  for (const auto& [name, t] : merged) {
    result.ops.push_back(OpStats{name, static_cast<double>(t.calls),
                                 static_cast<double>(t.self_ns) / 1e3,
                                 static_cast<double>(t.total_ns) / 1e3,
                                 static_cast<double>(t.self_allocations)});
  }
  if (!result.allocations_counted) {
    result.allocations = 0;
    for (auto& op : result.ops) op.self_allocations = 0;
  }
  // std::map gave name order; a stable sort keeps it among equal self times.
  std::stable_sort(result.ops.begin(), result.ops.end(),
                   [](const OpStats& a, const OpStats& b) { return a.self_us > b.self_us; });
  return result;
}

OpProfileResult OpProfileResult::per_step(int64_t steps) const {
  HP_CHECK_ARG(steps > 0, "OpProfileResult::per_step: steps ", steps, " must be at least 1");
  const double n = static_cast<double>(steps);
  OpProfileResult out = *this;
  out.wall_us /= n;
  out.allocations /= n;
  for (auto& op : out.ops) {
    op.calls /= n;
    op.self_us /= n;
    op.total_us /= n;
    op.self_allocations /= n;
  }
  return out;
}

std::string OpProfileResult::to_json() const {
  using json = nlohmann::json;
  const auto counted = [&](double v) { return allocations_counted ? json(v) : json(nullptr); };
  json rows = json::array();
  for (const auto& op : ops) {
    rows.push_back({{"name", op.name},
                   {"count", op.calls},
                   {"self_cpu_time", op.self_us},
                   {"cpu_time_total", op.total_us},
                   {"self_allocations", counted(op.self_allocations)}});
  }
  return json{{"time_unit", "us"}, {"wall_us", wall_us}, {"allocations", counted(allocations)},
              {"ops", rows}}
      .dump();
}

std::string OpProfileResult::table(size_t max_rows) const {
  std::string out = fmt::format("{:<44} {:>10} {:>12} {:>12} {:>11}\n", "op", "calls",
                                "self us", "total us", "self allocs");
  const size_t n = max_rows == 0 ? ops.size() : std::min(max_rows, ops.size());
  for (size_t i = 0; i < n; ++i) {
    const OpStats& op = ops[i];
    const std::string allocs =
        allocations_counted ? fmt::format("{:.1f}", op.self_allocations) : std::string("-");
    out += fmt::format("{:<44} {:>10.1f} {:>12.1f} {:>12.1f} {:>11}\n", op.name, op.calls,
                       op.self_us, op.total_us, allocs);
  }
  if (n < ops.size()) out += fmt::format("({} more ops)\n", ops.size() - n);
  return out;
}

}  // namespace hp
