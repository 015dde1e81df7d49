#include "hp/util/trace.h"

#include <nlohmann/json.hpp>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <map>
#include <mutex>
#include <stdexcept>

#include "hp/util/gpu_trace.h"

namespace hp::trace {
namespace {

struct Recorder {
  std::mutex mutex;
  std::vector<Event> events;
  GpuTimeline gpu;  // GPU spans not yet converted (gpu_trace.h)
  int pid = 0;
  std::string process_name;
};

std::atomic<bool> g_enabled{false};

Recorder& recorder() {
  static auto* r = new Recorder();  // never destroyed: spans may end during exit
  return *r;
}

using Steady = std::chrono::steady_clock;

// The origin as a steady-clock reading (in its ticks), and the wall-clock
// instant it stands for (0: the process's start, no shared instant).
std::atomic<Steady::rep> g_origin{Steady::now().time_since_epoch().count()};
std::atomic<int64_t> g_origin_unix_us{0};

bool is_gpu_lane(const std::string& lane) { return lane.rfind("gpu ", 0) == 0; }

}  // namespace

bool enabled() { return g_enabled.load(std::memory_order_relaxed); }

void enable(int pid, const std::string& process_name) {
  Recorder& r = recorder();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.events.clear();
  r.gpu.clear();
  r.pid = pid;
  r.process_name = process_name;
  g_enabled.store(true);
}

void disable() { g_enabled.store(false); }

int64_t now_us() {
  const Steady::duration since(Steady::now().time_since_epoch().count() -
                               g_origin.load(std::memory_order_relaxed));
  return std::chrono::duration_cast<std::chrono::microseconds>(since).count();
}

int64_t unix_now_us() {
  return std::chrono::duration_cast<std::chrono::microseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

void set_origin(int64_t unix_us) {
  // The steady reading that corresponds to `unix_us`: now, less the wall
  // time elapsed since that instant.
  const Steady::time_point steady_now = Steady::now();
  const std::chrono::microseconds elapsed(unix_now_us() - unix_us);
  g_origin.store((steady_now - std::chrono::duration_cast<Steady::duration>(elapsed))
                     .time_since_epoch()
                     .count());
  g_origin_unix_us.store(unix_us);
}

void record(std::string name, std::string category, std::string lane, int64_t start_us,
            int64_t end_us) {
  if (!enabled()) return;
  Recorder& r = recorder();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.events.push_back({std::move(name), std::move(category), std::move(lane), start_us, end_us});
}

Span::Span(std::string name, const char* category, const char* lane)
    : active_(enabled()), category_(category), lane_(lane), start_(0) {
  if (active_) {
    name_ = std::move(name);
    start_ = now_us();
  }
}

Span::Span(const char* prefix, const std::string& subject, const char* category,
           const char* lane)
    : active_(enabled()), category_(category), lane_(lane), start_(0) {
  if (active_) {
    name_ = prefix + subject;
    start_ = now_us();
  }
}

Span::~Span() {
  if (active_) record(std::move(name_), category_, lane_, start_, now_us());
}

void anchor_gpu(GpuMarkPtr mark, int64_t host_us) {
  if (!enabled()) return;
  Recorder& r = recorder();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.gpu.anchor(std::move(mark), host_us);
  r.gpu.resolve(/*wait=*/false, r.events);
}

void record_gpu(std::string name, std::string category, const std::string& lane,
                GpuMarkPtr start, GpuMarkPtr end) {
  if (!enabled()) return;
  Recorder& r = recorder();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.gpu.add(std::move(name), std::move(category), lane, std::move(start), std::move(end),
            r.events);
}

void resolve_gpu(bool wait) {
  Recorder& r = recorder();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.gpu.resolve(wait, r.events);
}

size_t pending_gpu_spans() {
  Recorder& r = recorder();
  std::lock_guard<std::mutex> lock(r.mutex);
  return r.gpu.pending();
}

std::vector<Event> events() {
  Recorder& r = recorder();
  std::lock_guard<std::mutex> lock(r.mutex);
  return r.events;
}

void write(const std::string& path) {
  Recorder& r = recorder();
  std::lock_guard<std::mutex> lock(r.mutex);
  // The GPU spans still pending: the one host wait a trace adds.
  r.gpu.resolve(/*wait=*/true, r.events);
  // Lanes become threads of this process, numbered in order of appearance
  // with the compute lane first, and the GPU lanes after the host's (a
  // viewer shows the host issuing above the device running).
  std::map<std::string, int> lanes{{"compute", 0}};
  for (const bool gpu : {false, true}) {
    for (const Event& e : r.events) {
      if (is_gpu_lane(e.lane) == gpu) lanes.emplace(e.lane, static_cast<int>(lanes.size()));
    }
  }
  nlohmann::json out = nlohmann::json::array();
  for (const Event& e : r.events) {
    const auto it = lanes.find(e.lane);
    out.push_back({{"name", e.name},
                   {"cat", e.category},
                   {"ph", "X"},
                   {"ts", e.start_us},
                   {"dur", std::max<int64_t>(0, e.end_us - e.start_us)},
                   {"pid", r.pid},
                   {"tid", it->second}});
  }
  out.push_back({{"name", "process_name"}, {"ph", "M"}, {"pid", r.pid},
                 {"args", {{"name", r.process_name}}}});
  for (const auto& [lane, tid] : lanes) {
    out.push_back({{"name", "thread_name"}, {"ph", "M"}, {"pid", r.pid}, {"tid", tid},
                   {"args", {{"name", lane}}}});
    out.push_back({{"name", "thread_sort_index"}, {"ph", "M"}, {"pid", r.pid}, {"tid", tid},
                   {"args", {{"sort_index", tid}}}});
  }
  nlohmann::json document{{"traceEvents", out}, {"displayTimeUnit", "ms"}};
  if (const int64_t origin = g_origin_unix_us.load(); origin != 0) {
    document["otherData"] = {{"origin_unix_us", origin}};
  }
  errno = 0;
  std::ofstream file(path);
  if (!file) {
    throw std::runtime_error("trace: cannot open '" + path + "' for writing: " +
                             std::strerror(errno));
  }
  file << document.dump() << "\n";
  if (!file) throw std::runtime_error("trace: writing '" + path + "' failed");
}

}  // namespace hp::trace
