// GPU spans for the trace (trace.h): what a device stream ran, timed by
// marks recorded on that stream, put on the trace's host timeline.
//
// A GPU runs asynchronously: the host issues a unit's kernels or a
// collective long before the device runs them, so host spans say when work
// was issued, not when it ran. A GpuMark is a point on a device stream (on
// CUDA a timing event: hp/util/cuda_timer.h); two marks bracket a span of
// the stream's work. Marks only give times relative to each other, so an
// anchor, a mark the host waited for at a known host time, converts them:
//
//   start_us = anchor.host_us + 1000 * anchor.mark.milliseconds_to(start)
//
// Each span converts with the anchor that was the latest when it was
// recorded (re-anchoring once per step bounds the drift between the device
// clock and the host's). Spans are resolved lazily: record_gpu() only keeps
// the marks; resolve_gpu() converts those whose marks the device reached,
// without waiting, and write() waits for the rest, once. No span costs a
// host wait.
//
// GpuTimeline is the bookkeeping alone, for tests with fake marks; the
// functions below drive the process-wide trace's own timeline.
//
// Threads: GpuTimeline is not synchronised (the trace locks around it); the
// functions below may be called from any thread. Errors: a mark's methods
// may raise (a CUDA error); resolve and write pass that on.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "hp/util/trace.h"

namespace hp::trace {

// A point on a device stream (see the file comment). Implementations: CUDA
// timing events (cuda_timer.h); a test's fake.
class GpuMark {
 public:
  virtual ~GpuMark() = default;
  // True once the stream passed the mark; never blocks.
  virtual bool reached() = 0;
  // Blocks the host until the stream passed the mark.
  virtual void synchronize() = 0;
  // Milliseconds of device time from this mark to `later` (negative when
  // `later` came first); both must have been reached.
  virtual double milliseconds_to(GpuMark& later) = 0;
};
using GpuMarkPtr = std::shared_ptr<GpuMark>;

// GPU lanes are named "gpu " + the host lane they stand beside.
std::string gpu_lane(const std::string& lane);

class GpuTimeline {
 public:
  // Past this many unresolved spans, add() resolves those already reached:
  // a program that never resolves keeps a bounded number of device events.
  static constexpr size_t kResolveAt = 4096;

  // Drops every span and anchor.
  void clear();
  // `mark` was reached at `host_us` (trace::now_us()): later spans convert
  // against it.
  void anchor(GpuMarkPtr mark, int64_t host_us);
  bool anchored() const { return !anchors_.empty(); }

  // Keeps the span [start, end) of lane gpu_lane(lane) until it resolves;
  // a span of category "wait" that resolves empty (the stream did not stand
  // still) is dropped. False, and nothing kept, before the first anchor or
  // with a null mark (nothing to convert against or with). May resolve
  // (kResolveAt) into `resolved`.
  bool add(std::string name, std::string category, const std::string& lane, GpuMarkPtr start,
           GpuMarkPtr end, std::vector<Event>& resolved);

  // Converts the spans whose marks were reached into `out`, in the order
  // they were added among themselves; with `wait`, waits for every mark
  // first. Marks of converted spans are released.
  void resolve(bool wait, std::vector<Event>& out);

  size_t pending() const { return pending_.size(); }

 private:
  struct Anchor {
    GpuMarkPtr mark;
    int64_t host_us;
  };
  struct Pending {
    std::string name, category, lane;
    GpuMarkPtr start, end;
    uint64_t anchor;  // absolute index: first_anchor_ + position in anchors_
  };
  int64_t to_host_us(const Anchor& anchor, GpuMark& mark) const;

  std::deque<Anchor> anchors_;
  uint64_t first_anchor_ = 0;  // absolute index of anchors_.front()
  std::vector<Pending> pending_;
};

// The process-wide trace's timeline. Each does nothing while tracing is off
// (trace::enabled()); callers test enabled() before making marks, so that
// a run without --trace records no device events.

// Anchors the GPU clock (GpuTimeline::anchor) and resolves, without
// waiting, the spans already reached: call it where the host has just waited
// for the device anyway.
void anchor_gpu(GpuMarkPtr mark, int64_t host_us);
// A span of GPU work on lane gpu_lane(lane) (GpuTimeline::add).
void record_gpu(std::string name, std::string category, const std::string& lane,
                GpuMarkPtr start, GpuMarkPtr end);
// Converts the reached spans into events(); `wait`: every span, waiting for
// the device (write() does that before writing).
void resolve_gpu(bool wait = false);
size_t pending_gpu_spans();

}  // namespace hp::trace
