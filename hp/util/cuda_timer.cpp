#include "hp/util/cuda_timer.h"

#include <c10/core/Event.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include "hp/util/error.h"
#include "hp/util/torch_compat.h"

namespace hp {

struct CudaTimer::Events {
  // BACKEND_DEFAULT: CUDA events that keep their timestamps (torch's
  // default flag disables timing).
  c10::Event start{c10::DeviceType::CUDA, c10::EventFlag::BACKEND_DEFAULT};
  c10::Event stop{c10::DeviceType::CUDA, c10::EventFlag::BACKEND_DEFAULT};
};

CudaTimer::CudaTimer(c10::Device device) : device_(device) {
  HP_CHECK_ARG(device.is_cuda(), "CudaTimer: expected a CUDA device, got ", device);
#if !HP_TORCH_AT_LEAST(2, 11)
  HP_CHECK_ARG(false, "CudaTimer needs libtorch 2.11 or later (CUDA event timing); this one is ",
               compat::torch_version());
#endif
  compat::require_cuda("CudaTimer");
  events_ = std::make_unique<Events>();
}

CudaTimer::~CudaTimer() = default;
CudaTimer::CudaTimer(CudaTimer&&) noexcept = default;
CudaTimer& CudaTimer::operator=(CudaTimer&&) noexcept = default;

namespace {

c10::Stream current_stream(c10::Device device) {
  return c10::impl::getDeviceGuardImpl(device.type())->getStream(device);
}

}  // namespace

void CudaTimer::start() { events_->start.record(current_stream(device_)); }

void CudaTimer::stop() { events_->stop.record(current_stream(device_)); }

double CudaTimer::seconds() {
#if HP_TORCH_AT_LEAST(2, 11)
  events_->stop.synchronize();
  return events_->start.elapsedTime(events_->stop) * 1e-3;  // milliseconds
#else
  return 0;  // unreachable: the constructor refused this libtorch
#endif
}

}  // namespace hp
