#include "hp/distributed/stream_ops.h"

#include <c10/core/Event.h>
#include <c10/core/Stream.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <array>
#include <chrono>
#include <map>
#include <mutex>
#include <thread>

#include "hp/util/cuda_timer.h"
#include "hp/util/error.h"
#include "hp/util/torch_compat.h"

namespace hp::dist {

const char* to_string(StreamRole role) {
  switch (role) {
    case StreamRole::kCompute: return "compute";
    case StreamRole::kCopyIn: return "copy_in";
    case StreamRole::kAllGather: return "all_gather";
    case StreamRole::kReduceScatter: return "reduce_scatter";
    case StreamRole::kAllReduce: return "all_reduce";
  }
  return "?";
}

namespace {

// The host orders everything: nothing to do.
class HostStreamOps final : public StreamOps {
 public:
  bool orders_by_streams() const override { return false; }
  StreamRole current() const override { return StreamRole::kCompute; }
  StreamRole set_current(StreamRole) override { return StreamRole::kCompute; }
  StreamEvent record(StreamRole, const char*) override { return {}; }
  void wait(StreamRole, const StreamEvent&) override {}
  void host_wait(const StreamEvent&) override {}
  bool query(const StreamEvent&) override { return true; }
};

// c10's streams and events for one CUDA device, through the device-generic
// interfaces (no CUDA headers: the same code compiles on CPU-only builds and
// is reached only with a CUDA tensor).
class CudaStreamOps final : public StreamOps {
 public:
  explicit CudaStreamOps(c10::Device device)
      : device_(device), impl_(c10::impl::getDeviceGuardImpl(device.type())) {
    // From c10's pools, as FSDP2 takes them: copy-in, all-gather and
    // reduce-scatter at high priority (a gather or reduction that waits
    // behind compute kernels delays the next unit), the all-reduce at
    // default priority (it has a whole backward to finish).
    streams_[index(StreamRole::kCompute)] = impl_->getStream(device_);
    streams_[index(StreamRole::kCopyIn)] = impl_->getStreamFromGlobalPool(device_, true);
    streams_[index(StreamRole::kAllGather)] = impl_->getStreamFromGlobalPool(device_, true);
    streams_[index(StreamRole::kReduceScatter)] = impl_->getStreamFromGlobalPool(device_, true);
    streams_[index(StreamRole::kAllReduce)] = impl_->getStreamFromGlobalPool(device_, false);
  }

  bool orders_by_streams() const override { return true; }

  void begin_iteration() override {
    streams_[index(StreamRole::kCompute)] = impl_->getStream(device_);
  }

  StreamRole current() const override {
    const c10::Stream now = impl_->getStream(device_);
    for (int i = 1; i < kStreamRoleCount; ++i) {
      if (streams_[i] == now) return static_cast<StreamRole>(i);
    }
    return StreamRole::kCompute;
  }

  StreamRole set_current(StreamRole role) override {
    const StreamRole before = current();
    impl_->exchangeStream(streams_[index(role)]);
    return before;
  }

  StreamEvent record(StreamRole stream, const char*) override {
    StreamEvent event;
    event.id = next_id_.fetch_add(1, std::memory_order_relaxed);
    event.stream = stream;
    event.native = take_event();
    event.native->record(streams_[index(stream)]);
    return event;
  }

  void wait(StreamRole waiter, const StreamEvent& event) override {
    if (event.native) event.native->block(streams_[index(waiter)]);
  }

  void host_wait(const StreamEvent& event) override {
    if (!event.native) return;
#if HP_TORCH_AT_LEAST(2, 0)
    event.native->synchronize();
#else
    while (!event.native->query()) std::this_thread::sleep_for(std::chrono::microseconds(20));
#endif
  }

  bool query(const StreamEvent& event) override { return !event.native || event.native->query(); }

  std::shared_ptr<trace::GpuMark> trace_mark(StreamRole stream) override {
    return cuda_trace_mark(streams_[index(stream)]);
  }

 private:
  static size_t index(StreamRole role) { return static_cast<size_t>(role); }

  // Events are reused: creating a CUDA event per collective costs a driver
  // call each. The deleter returns it to the pool, which outlives every
  // handle (the ops live until the process exits).
  std::shared_ptr<c10::Event> take_event() {
    c10::Event* event = nullptr;
    {
      std::lock_guard<std::mutex> lock(pool_mutex_);
      if (!pool_.empty()) {
        event = pool_.back().release();
        pool_.pop_back();
      }
    }
    if (event == nullptr) event = new c10::Event(device_.type());
    return std::shared_ptr<c10::Event>(event, [this](c10::Event* e) {
      std::lock_guard<std::mutex> lock(pool_mutex_);
      pool_.emplace_back(e);
    });
  }

  const c10::Device device_;
  const c10::impl::DeviceGuardImplInterface* impl_;
  std::array<c10::Stream, kStreamRoleCount> streams_{
      c10::Stream(c10::Stream::DEFAULT, c10::Device(c10::DeviceType::CPU)),
      c10::Stream(c10::Stream::DEFAULT, c10::Device(c10::DeviceType::CPU)),
      c10::Stream(c10::Stream::DEFAULT, c10::Device(c10::DeviceType::CPU)),
      c10::Stream(c10::Stream::DEFAULT, c10::Device(c10::DeviceType::CPU)),
      c10::Stream(c10::Stream::DEFAULT, c10::Device(c10::DeviceType::CPU))};
  std::atomic<uint64_t> next_id_{1};
  std::mutex pool_mutex_;
  std::vector<std::unique_ptr<c10::Event>> pool_;
};

struct Registry {
  std::mutex mutex;
  std::shared_ptr<StreamOps> cpu = std::make_shared<HostStreamOps>();
  // Never destroyed: events handed out may be dropped during static
  // destruction, after the driver shut down; leaking the ops keeps their
  // pools alive for that.
  std::map<int, StreamOps*> cuda;
  // Installed by ScopedStreamOps in front of `cuda`, by device index.
  std::map<int, std::shared_ptr<StreamOps>> cuda_installed;
};

Registry& registry() {
  static Registry* r = new Registry();
  return *r;
}

}  // namespace

StreamOps& stream_ops_for(c10::Device device) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  if (!device.is_cuda()) return *r.cpu;
  const int index = device.has_index() ? device.index() : 0;
  if (auto installed = r.cuda_installed.find(index); installed != r.cuda_installed.end()) {
    return *installed->second;
  }
  auto it = r.cuda.find(index);
  if (it == r.cuda.end()) {
    it = r.cuda.emplace(index, new CudaStreamOps(c10::Device(c10::DeviceType::CUDA, index))).first;
  }
  return *it->second;
}

namespace {

int cuda_index(c10::Device device) { return device.has_index() ? device.index() : 0; }

}  // namespace

ScopedStreamOps::ScopedStreamOps(std::shared_ptr<StreamOps> ops, c10::Device device)
    : device_(device) {
  HP_CHECK_ARG(ops != nullptr, "ScopedStreamOps: ops must not be null");
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  if (!device.is_cuda()) {
    previous_ = std::exchange(r.cpu, std::move(ops));
    return;
  }
  std::shared_ptr<StreamOps>& slot = r.cuda_installed[cuda_index(device)];
  previous_ = std::exchange(slot, std::move(ops));
}

ScopedStreamOps::~ScopedStreamOps() {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  if (!device_.is_cuda()) {
    r.cpu = std::move(previous_);
  } else if (previous_) {
    r.cuda_installed[cuda_index(device_)] = std::move(previous_);
  } else {
    r.cuda_installed.erase(cuda_index(device_));
  }
}

}  // namespace hp::dist
