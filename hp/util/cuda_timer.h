// GPU time of a span of work on a CUDA device's current stream, from a pair
// of CUDA timing events: what the GPU took from the start mark to the stop
// mark, including any time the stream stood idle between them (a host that
// enqueues too slowly, a wait on another stream). The host does not wait
// until seconds() is asked for.
//
// Through libtorch's device-generic event interface: no CUDA headers. On a
// libtorch without event timing (before 2.11) or without CUDA, the
// constructor raises ArgumentError naming what is missing.
//
// Threads: one thread at a time; marks go on that thread's current stream.
#pragma once

#include <c10/core/Device.h>

#include <memory>

namespace hp {

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
  struct Events;
  c10::Device device_;
  std::unique_ptr<Events> events_;
};

}  // namespace hp
