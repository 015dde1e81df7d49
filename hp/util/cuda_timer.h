// GPU time on CUDA streams from timing events, through libtorch's
// device-generic event interface (no CUDA headers). On a libtorch without
// event timing (before 2.11) or without CUDA, CudaTimer's constructor raises
// ArgumentError naming what is missing, and cuda_trace_mark() returns null.
//
// One timing event is the primitive of both uses here: CudaTimer, a pair of
// marks whose GPU time a caller asks for; and the trace's GPU marks
// (gpu_trace.h). Events are pooled per device: creating a CUDA event per
// mark costs a driver call each. The pool is never destroyed, so an event
// dropped during static destruction never meets a driver that shut down.
//
// Threads: a CudaTimer, one thread at a time (marks go on that thread's
// current stream); the mark functions, any thread.
#pragma once

#include <c10/core/Device.h>
#include <c10/core/Stream.h>

#include <memory>

namespace hp {

namespace trace {
class GpuMark;
}

// GPU time of a span of work on a CUDA device's current stream: what the GPU
// took from the start mark to the stop mark, including any time the stream
// stood idle between them (a host that enqueues too slowly, a wait on
// another stream). The host does not wait until seconds() is asked for.
class CudaTimer {
 public:
  explicit CudaTimer(c10::Device device);
  ~CudaTimer();
  CudaTimer(CudaTimer&&) noexcept;
  CudaTimer& operator=(CudaTimer&&) noexcept;

  void start();  // marks the current stream
  void stop();   // marks it again
  // Waits for the stop mark; the GPU seconds between the two marks.
  double seconds();

 private:
  c10::Device device_;
  std::shared_ptr<trace::GpuMark> start_, stop_;
};

// A timing mark recorded on `stream` now (a CUDA stream), for the trace:
// null on a libtorch without event timing. The host does not wait.
std::shared_ptr<trace::GpuMark> cuda_trace_mark(const c10::Stream& stream);
// The same on `device`'s current stream.
std::shared_ptr<trace::GpuMark> cuda_trace_mark(c10::Device device);

// Anchors the trace's GPU clock (trace::anchor_gpu) on `device`: waits for
// its current stream, marks it and waits for the mark, which then stands at
// the host time between the mark's issue and the wait's return (the stream
// is idle, so a few microseconds apart). A host sync: call it only while
// tracing, where the host waits for the device anyway. Nothing without
// event timing, or while tracing is off.
void anchor_cuda_trace(c10::Device device);

}  // namespace hp
