#include "hp/util/cuda_timer.h"

#include <c10/core/Event.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <map>
#include <mutex>
#include <utility>
#include <vector>

#include "hp/util/error.h"
#include "hp/util/gpu_trace.h"
#include "hp/util/torch_compat.h"

namespace hp {
namespace {

c10::Stream current_stream(c10::Device device) {
  return c10::impl::getDeviceGuardImpl(device.type())->getStream(device);
}

#if HP_TORCH_AT_LEAST(2, 11)

// Timing events by device index: a CUDA event belongs to the device it was
// first recorded on. Never destroyed (see the header).
class EventPool {
 public:
  static EventPool& get() {
    static auto* pool = new EventPool();
    return *pool;
  }

  std::unique_ptr<c10::Event> take(c10::DeviceIndex device) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      std::vector<std::unique_ptr<c10::Event>>& free = free_[device];
      if (!free.empty()) {
        std::unique_ptr<c10::Event> event = std::move(free.back());
        free.pop_back();
        return event;
      }
    }
    // BACKEND_DEFAULT: CUDA events that keep their timestamps (torch's
    // default flag disables timing).
    return std::make_unique<c10::Event>(c10::DeviceType::CUDA, c10::EventFlag::BACKEND_DEFAULT);
  }

  void give_back(c10::DeviceIndex device, std::unique_ptr<c10::Event> event) {
    std::lock_guard<std::mutex> lock(mutex_);
    free_[device].push_back(std::move(event));
  }

 private:
  std::mutex mutex_;
  std::map<c10::DeviceIndex, std::vector<std::unique_ptr<c10::Event>>> free_;
};

// One timing event recorded on a stream; back to the pool when dropped.
class CudaMark final : public trace::GpuMark {
 public:
  explicit CudaMark(const c10::Stream& stream)
      : device_(stream.device_index()), event_(EventPool::get().take(device_)) {
    event_->record(stream);
  }
  ~CudaMark() override { EventPool::get().give_back(device_, std::move(event_)); }

  bool reached() override { return event_->query(); }
  void synchronize() override { event_->synchronize(); }
  double milliseconds_to(trace::GpuMark& later) override {
    // Marks of one process are all CUDA marks or all a test's fakes: the
    // trace never pairs the two kinds.
    return event_->elapsedTime(*static_cast<CudaMark&>(later).event_);
  }

 private:
  c10::DeviceIndex device_;
  std::unique_ptr<c10::Event> event_;
};

#endif

}  // namespace

std::shared_ptr<trace::GpuMark> cuda_trace_mark(const c10::Stream& stream) {
#if HP_TORCH_AT_LEAST(2, 11)
  return std::make_shared<CudaMark>(stream);
#else
  (void)stream;
  return nullptr;
#endif
}

std::shared_ptr<trace::GpuMark> cuda_trace_mark(c10::Device device) {
  return cuda_trace_mark(current_stream(device));
}

void anchor_cuda_trace(c10::Device device) {
  if (!trace::enabled()) return;
  const c10::Stream stream = current_stream(device);
  stream.synchronize();
  const int64_t issued = trace::now_us();
  std::shared_ptr<trace::GpuMark> mark = cuda_trace_mark(stream);
  if (!mark) return;
  mark->synchronize();
  const int64_t reached = trace::now_us();
  trace::anchor_gpu(std::move(mark), issued + (reached - issued) / 2);
}

CudaTimer::CudaTimer(c10::Device device) : device_(device) {
  HP_CHECK_ARG(device.is_cuda(), "CudaTimer: expected a CUDA device, got ", device);
#if !HP_TORCH_AT_LEAST(2, 11)
  HP_CHECK_ARG(false, "CudaTimer needs libtorch 2.11 or later (CUDA event timing); this one is ",
               compat::torch_version());
#endif
  compat::require_cuda("CudaTimer");
}

CudaTimer::~CudaTimer() = default;
CudaTimer::CudaTimer(CudaTimer&&) noexcept = default;
CudaTimer& CudaTimer::operator=(CudaTimer&&) noexcept = default;

void CudaTimer::start() { start_ = cuda_trace_mark(device_); }

void CudaTimer::stop() { stop_ = cuda_trace_mark(device_); }

double CudaTimer::seconds() {
  HP_CHECK_ARG(start_ && stop_, "CudaTimer::seconds: start() and stop() first");
  stop_->synchronize();
  return start_->milliseconds_to(*stop_) * 1e-3;  // milliseconds
}

}  // namespace hp
