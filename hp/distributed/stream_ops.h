// Every stream, event and wait decision of the FSDP layer and of the
// collectives facade goes through one interface, so that a CPU test can
// record the decisions a GPU run would make and check them
// (docs/streams.md describes the streams, the events and the rules).
//
// Three implementations:
//   CUDA       c10 streams and events: the copy-in, all-gather and
//              reduce-scatter streams at high priority, the all-reduce stream
//              at default priority (taken from c10's pools, once per device),
//              events pooled; no host waits except host_wait().
//   host       the host orders everything (Gloo on the CPU): every call is a
//              no-op and orders_by_streams() is false, so the FSDP layer runs
//              its host schedule.
//   recording  for tests: orders_by_streams() is true, so the FSDP layer runs
//              the schedule a GPU would, and every record, wait, allocation,
//              use and release is appended to a log (with its stream and
//              tag); the collectives' host waits keep the data correct
//              underneath.
//
// Which one a device gets: stream_ops_for(device). CUDA devices get their
// CUDA ops; the CPU gets the host ops, or the recording ops a
// ScopedStreamOps installed.
//
// Threads: an implementation's calls come from the thread that drives a
// fully_shard tree (its hooks run one at a time: docs/design.md) and from
// Work::wait() callers; the recording ops lock their log. Streams are
// per-thread "current" state in c10; StreamScope sets and restores it on
// the calling thread.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <c10/core/Device.h>

namespace c10 {
struct Event;
}
namespace hp::trace {
class GpuMark;
}

namespace hp::dist {

// The streams of the design, by what runs on them. kCompute is the stream
// the caller computes on (the current stream when an iteration starts).
enum class StreamRole : uint8_t { kCompute, kCopyIn, kAllGather, kReduceScatter, kAllReduce };
constexpr int kStreamRoleCount = 5;
const char* to_string(StreamRole role);

// An event recorded on a stream: a copyable handle. `id` is unique per
// StreamOps (0: none, which every wait treats as already complete); a CUDA
// event goes back to its pool when the last handle drops.
struct StreamEvent {
  uint64_t id = 0;
  StreamRole stream = StreamRole::kCompute;  // where it was recorded
  std::shared_ptr<c10::Event> native;        // CUDA only
  bool defined() const { return id != 0; }
};

class StreamOps {
 public:
  virtual ~StreamOps() = default;

  // True when streams order the work (CUDA, recording): the FSDP layer then
  // issues every stage as soon as its inputs are recorded and waits events;
  // false when the host orders it (Gloo on the CPU).
  virtual bool orders_by_streams() const = 0;
  // An iteration starts (the root's pre-forward): the compute stream is the
  // caller's current one from now on.
  virtual void begin_iteration() {}

  virtual StreamRole current() const = 0;
  // Makes `role` the calling thread's current stream; returns the previous
  // one (StreamScope restores it).
  virtual StreamRole set_current(StreamRole role) = 0;

  virtual StreamEvent record(StreamRole stream, const char* tag) = 0;
  // `waiter` runs nothing queued after this until `event` completed. An
  // undefined event is complete.
  virtual void wait(StreamRole waiter, const StreamEvent& event) = 0;
  // wait(waiter, record(waited)): everything queued on `waited` so far.
  void wait_stream(StreamRole waiter, StreamRole waited, const char* tag) {
    wait(waiter, record(waited, tag));
  }
  // The host blocks until `event` completed.
  virtual void host_wait(const StreamEvent& event) = 0;
  virtual bool query(const StreamEvent& event) = 0;

  // Buffer bookkeeping, for the recording ops' checks (no-ops elsewhere).
  // `buffer` identifies the memory (its data pointer or storage).
  virtual void on_alloc(const void* buffer, StreamRole stream, const char* what) {}
  virtual void on_use(const void* buffer, StreamRole stream) {}
  virtual void on_release(const void* buffer, StreamRole stream) {}
  // A collective issued on `stream` (the trace's and the simulator's marker).
  virtual void on_collective(StreamRole stream, const char* op, int64_t bytes) {}
  // A named point of the schedule (iteration start, end of backward, a
  // failure's cleanup), for the checks.
  virtual void on_mark(const char* what) {}

  // A timing mark on `stream` now, for the trace's GPU spans (gpu_trace.h):
  // CUDA records a timing event there; null where no device stream runs the
  // work (the host ops, the recording ops) or this libtorch cannot time
  // events. Called only while tracing.
  virtual std::shared_ptr<trace::GpuMark> trace_mark(StreamRole stream) { return nullptr; }
};

// Sets `role` current on the calling thread for the scope; restores the
// previous stream after. A null ops pointer does nothing.
class StreamScope {
 public:
  StreamScope(StreamOps* ops, StreamRole role)
      : ops_(ops), previous_(ops ? ops->set_current(role) : role) {}
  ~StreamScope() {
    if (ops_) ops_->set_current(previous_);
  }
  StreamScope(const StreamScope&) = delete;
  StreamScope& operator=(const StreamScope&) = delete;

 private:
  StreamOps* ops_;
  StreamRole previous_;
};

// The ops for tensors on `device` (see the file comment). The returned ops
// live until the process exits (or, for an installed recording, until its
// ScopedStreamOps ends).
StreamOps& stream_ops_for(c10::Device device);

// Installs `ops` for the CPU for its lifetime (tests: RecordingStreamOps),
// restoring the previous ones after. Not for use while a collective or a
// fully_shard step is in flight.
//
// With a CUDA device: installs `ops` for that device instead, in front of
// its CUDA ops, so that a GPU test can wrap them (a wrapper that forwards
// every call to stream_ops_for(device), taken before, and marks the
// streams with timing events: tests/cuda/overlap_test.cpp). A fully_shard
// tree keeps the ops it found at its first forward, and a Work the ops of
// its issue: both must be gone before the scope ends.
class ScopedStreamOps {
 public:
  explicit ScopedStreamOps(std::shared_ptr<StreamOps> ops,
                           c10::Device device = c10::Device(c10::DeviceType::CPU));
  ~ScopedStreamOps();
  ScopedStreamOps(const ScopedStreamOps&) = delete;
  ScopedStreamOps& operator=(const ScopedStreamOps&) = delete;

 private:
  c10::Device device_;
  std::shared_ptr<StreamOps> previous_;
};

}  // namespace hp::dist
