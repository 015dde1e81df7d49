#include "hp/distributed/work.h"

#include <ATen/ATen.h>
#include <c10/core/Event.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <array>
#include <atomic>
#include <condition_variable>
#include <mutex>
#include <optional>
#include <utility>
#include <vector>

#include "hp/distributed/comm_stats.h"
#include "hp/distributed/work_launch.h"
#include "hp/util/cuda_timer.h"
#include "hp/util/error.h"
#include "hp/util/gpu_trace.h"
#include "hp/util/trace.h"

namespace hp::dist {

// What a Work needs to finish a collective and to explain a failure.
//
// Host path (Gloo, the channel): the backend reports completion through its
// future, on its own thread; complete() runs the local step there, records
// an event on that thread's stream for CUDA tensors, and marks the state
// finished; wait_on() blocks until then. Stream path (NCCL): launch() runs
// the local step right behind the collective on the issuing stream and
// records `done` there; the state is finished at issue.
//
// The text a failure message needs is not built on the success path: the
// group's description is the group's own shared string, and `sizes` formats
// the arguments only when called.
struct Work::State {
  const char* op = "";
  std::shared_ptr<const std::string> group;  // Group::describe()
  uint64_t sequence = 0;
  int group_rank = 0;
  std::chrono::milliseconds timeout{0};
  std::function<std::string()> sizes;
  int64_t issued_us = 0;  // trace::now_us()
  c10::Device device{c10::DeviceType::CPU};
  StreamOps* ops = nullptr;  // the device's, when they order by streams
  bool host_completion = true;
  // A point-to-point op (p2p.h): `sequence` is its number among this rank's
  // ops of that direction with the peer (group rank `peer`, global rank
  // `peer_global`; -1 for a coalesced batch, whose `sizes` names each op).
  bool p2p = false;
  int peer = -1, peer_global = -1;

  std::mutex mutex;
  std::condition_variable finished_cv;
  bool completing = false;  // complete() is running
  bool finished = false;
  bool waited = false;
  int64_t completed_us = -1;
  std::exception_ptr error;
  c10::intrusive_ptr<c10d::Work> backend_work;  // dropped once finished
  std::function<void()> finish;                 // the local step
  // Host path without a future (Gloo's sends and receives): the first
  // wait runs it, then complete().
  detail::P2PWaiter waiter;
  StreamEvent done;

  // Runs the local step once; `cause` is the backend's error.
  void complete(std::exception_ptr cause);
  // Blocks until complete() ran (host path); accounts the wait.
  void wait_host();
};

namespace {

// Every collective updates these, from any thread: relaxed atomics, so
// that counting costs no lock. Each counter is exact; a snapshot taken while
// collectives are in flight may mix moments (benchmarks read between steps).
struct Stats {
  std::array<std::atomic<int64_t>, kOpTypeCount> calls{};  // indexed by OpType
  std::atomic<int64_t> comm_us{0}, wait_us{0};  // microseconds, summed exactly
};
Stats g_stats;

// The stream waits timed by Work::wait_on() (set_stream_wait_timing).
// Each read folds the timers into `seconds` and drops them: no CUDA event
// outlives the reading, so none is left for static destruction, when
// destroying one would meet a CUDA driver already shutting down.
struct StreamWaitTimes {
  std::atomic<bool> on{false};
  std::mutex mutex;
  std::vector<CudaTimer> waits;  // not yet read
  double seconds = 0;            // of those read since the last reset
};
StreamWaitTimes g_stream_waits;

std::string failure_message(const Work::State& s, const std::string& cause) {
  if (s.p2p && s.peer >= 0) {
    const bool send = std::string(s.op) == "send";
    return cat(s.op, " failed on ", *s.group, " (this rank is group rank ", s.group_rank,
               "; peer global rank ", s.peer_global, ", group rank ", s.peer,
               "; p2p sequence number ", s.sequence, send ? " to" : " from", " that peer, timeout ",
               s.timeout.count(), " ms); ", s.sizes(), ": ", cause);
  }
  if (s.p2p) {
    return cat(s.op, " failed on ", *s.group, " (this rank is group rank ", s.group_rank,
               ", timeout ", s.timeout.count(), " ms); ", s.sizes(), ": ", cause);
  }
  return cat(s.op, " failed on ", *s.group, " (this rank is group rank ", s.group_rank,
             ", sequence number ", s.sequence, ", timeout ", s.timeout.count(), " ms); ",
             s.sizes(), ": ", cause);
}

// The op's name in the trace: "all_reduce group 'world' ranks [0, 1] #3",
// "send group 'world' ranks [0, 1] to rank 1 #0".
std::string trace_name(const Work::State& s) {
  if (!s.p2p || s.peer < 0) return cat(s.op, " ", *s.group, " #", s.sequence);
  return cat(s.op, " ", *s.group, std::string(s.op) == "send" ? " to" : " from", " rank ",
             s.peer_global, " #", s.sequence);
}

std::string describe_exception(const Work::State& s, std::exception_ptr e) {
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& ex) {
    return failure_message(s, exception_message(ex));
  } catch (...) {
    return failure_message(s, "unknown error");
  }
}

// The fields every op's state takes from its group and launch info.
template <typename Info>
std::shared_ptr<Work::State> new_state(Group& group, Info& info, std::function<void()> finish) {
  auto state = std::make_shared<Work::State>();
  state->op = info.op;
  state->group = group.shared_description();
  state->group_rank = group.rank();
  state->timeout = group.timeout();
  state->sizes = std::move(info.sizes);
  state->finish = std::move(finish);
  state->device = info.device;
  StreamOps& ops = stream_ops_for(info.device);
  if (ops.orders_by_streams()) state->ops = &ops;
  return state;
}

// A collective's state, with its sequence number claimed and (under
// HP_CHECK_COLLECTIVES) the call compared across the group.
std::shared_ptr<Work::State> begin(Group& group, detail::LaunchInfo& info,
                                   std::function<void()> finish) {
  auto state = new_state(group, info, std::move(finish));
  state->sequence = group.next_sequence_number();
  info.fingerprint.sequence = state->sequence;
  try {
    if (collective_checks_enabled()) verify_same_call(group, info.fingerprint);
  } catch (const CollectiveError&) {
    throw;
  } catch (const std::exception& e) {
    throw CollectiveError(failure_message(*state, exception_message(e)));
  }
  state->issued_us = trace::now_us();
  g_stats.calls[static_cast<size_t>(info.fingerprint.op)].fetch_add(1, std::memory_order_relaxed);
  return state;
}

// A point-to-point op's state: nothing of the group's sequence, no
// cross-rank comparison (ranks issue different numbers of them).
std::shared_ptr<Work::State> begin_p2p(Group& group, detail::P2PInfo& info,
                                       std::function<void()> finish) {
  auto state = new_state(group, info, std::move(finish));
  state->sequence = info.sequence;
  state->p2p = true;
  state->peer = info.peer;
  state->peer_global = info.peer >= 0 ? group.global_rank(info.peer) : -1;
  state->issued_us = trace::now_us();
  constexpr auto relaxed = std::memory_order_relaxed;
  g_stats.calls[static_cast<size_t>(OpType::kSend)].fetch_add(info.sends, relaxed);
  g_stats.calls[static_cast<size_t>(OpType::kRecv)].fetch_add(info.recvs, relaxed);
  return state;
}

// The stream path's end of issue: the local step behind the collective on
// the issuing stream, then the event.
void finish_on_stream(Work::State& s) {
  try {
    if (s.finish) s.finish();
  } catch (...) {
    s.finish = nullptr;
    throw CollectiveError(describe_exception(s, std::current_exception()));
  }
  s.finish = nullptr;
  s.host_completion = false;
  s.finished = true;
  s.completed_us = s.issued_us;
  if (s.ops) s.done = s.ops->record(s.ops->current(), s.op);
}

// The trace of a collective that ran on the issuing stream: the host's
// issue (the host does not wait for it: no completion to record) and the
// device's run, from `gpu_start` to the stream after the local step.
void trace_on_stream(Work::State& s, trace::GpuMarkPtr gpu_start) {
  std::string name = trace_name(s);
  trace::record("issue " + name, "comm", s.op, s.issued_us, trace::now_us());
  trace::record_gpu(std::move(name), "comm", s.op, std::move(gpu_start),
                    s.ops->trace_mark(s.ops->current()));
}

}  // namespace

namespace detail {

Work launch_on_channel(Group& group, LaunchInfo info, ShmChannel::Op channel_op,
                       std::function<void()> finish) {
  std::shared_ptr<Work::State> state = begin(group, info, std::move(finish));
  if (state->ops) {
    // The stream the host-completed collective stands for, in the log.
    const StreamRole on = state->ops->current();
    state->ops->on_collective(on, info.op, info.bytes);
    state->done = state->ops->record(on, info.op);
  }
  // A weak reference, as for the backend's future: a dropped Work is not
  // kept alive by the channel.
  std::weak_ptr<Work::State> weak = state;
  group.shm_channel()->submit(std::move(channel_op), [weak](std::exception_ptr cause) {
    if (auto s = weak.lock()) s->complete(cause);
  });
  return Work(std::move(state));
}

namespace {

// launch()'s issue, for any begun state: what a collective and a
// point-to-point op on the stream path share.
Work issue_on_backend(Group& group, std::shared_ptr<Work::State> state, int64_t bytes,
                      const std::function<c10::intrusive_ptr<c10d::Work>()>& issue) {
  const bool nccl = group.backend_type() == BackendType::kNccl;
  if (state->ops && issue) state->ops->on_collective(state->ops->current(), state->op, bytes);
  // Where the collective runs on the issuing stream, the trace marks that
  // stream around it: when the device ran it, beside when the host issued it.
  trace::GpuMarkPtr gpu_start;
  if (state->ops && trace::enabled()) gpu_start = state->ops->trace_mark(state->ops->current());
  c10::intrusive_ptr<c10d::Work> backend_work;
  try {
    if (issue) backend_work = issue();
    if (nccl && backend_work) {
      // Where this libtorch has no asyncOp=false (or ignored it), c10d ran
      // the collective on a stream of its own: the current stream waits
      // for it here, which queues a wait and does not block the host (a
      // barrier does block: that is what a barrier is for).
      backend_work->wait();
      backend_work.reset();
    }
  } catch (const CollectiveError&) {
    throw;
  } catch (const std::exception& e) {
    throw CollectiveError(failure_message(*state, exception_message(e)));
  }
  if (!backend_work) {
    // NCCL, or nothing to communicate: done on the current stream.
    finish_on_stream(*state);
    if (gpu_start) trace_on_stream(*state, std::move(gpu_start));
    return Work(std::move(state));
  }
  if (state->ops) state->done = state->ops->record(state->ops->current(), state->op);
  {
    std::lock_guard<std::mutex> lock(state->mutex);
    state->backend_work = backend_work;
  }
  // A weak reference: the backend's future may outlive the Work. If it has
  // already completed, addCallback runs the callback right here.
  std::weak_ptr<Work::State> weak = state;
  backend_work->getFuture()->addCallback([weak](c10::ivalue::Future& future) {
    auto s = weak.lock();
    if (!s) return;
    s->complete(future.hasError() ? future.exception_ptr() : nullptr);
  });
  return Work(std::move(state));
}

}  // namespace

Work launch(Group& group, LaunchInfo info,
            const std::function<c10::intrusive_ptr<c10d::Work>()>& issue,
            std::function<void()> finish) {
  std::shared_ptr<Work::State> state = begin(group, info, std::move(finish));
  return issue_on_backend(group, std::move(state), info.bytes, issue);
}

Work launch_p2p_on_stream(Group& group, P2PInfo info,
                          const std::function<c10::intrusive_ptr<c10d::Work>()>& issue) {
  std::shared_ptr<Work::State> state = begin_p2p(group, info, nullptr);
  return issue_on_backend(group, std::move(state), info.bytes, issue);
}

Work launch_p2p(Group& group, P2PInfo info, const std::function<P2PWaiter()>& issue,
                std::function<void()> finish) {
  std::shared_ptr<Work::State> state = begin_p2p(group, info, std::move(finish));
  if (state->ops) state->ops->on_collective(state->ops->current(), info.op, info.bytes);
  P2PWaiter waiter;
  try {
    if (issue) waiter = issue();
  } catch (const CollectiveError&) {
    throw;
  } catch (const std::exception& e) {
    throw CollectiveError(failure_message(*state, exception_message(e)));
  }
  if (state->ops) state->done = state->ops->record(state->ops->current(), info.op);
  if (!waiter) {
    state->complete(nullptr);  // nothing on the wire: done here
  } else {
    std::lock_guard<std::mutex> lock(state->mutex);
    state->waiter = std::move(waiter);
  }
  return Work(std::move(state));
}

}  // namespace detail

CommStats comm_stats() {
  constexpr auto relaxed = std::memory_order_relaxed;
  CommStats stats;
  for (size_t i = 0; i < stats.calls.size(); ++i) stats.calls[i] = g_stats.calls[i].load(relaxed);
  stats.comm_seconds = g_stats.comm_us.load(relaxed) * 1e-6;
  stats.wait_seconds = g_stats.wait_us.load(relaxed) * 1e-6;
  return stats;
}

void reset_comm_stats() {
  for (auto& counter : g_stats.calls) counter.store(0, std::memory_order_relaxed);
  g_stats.comm_us.store(0, std::memory_order_relaxed);
  g_stats.wait_us.store(0, std::memory_order_relaxed);
  std::lock_guard<std::mutex> lock(g_stream_waits.mutex);
  g_stream_waits.waits.clear();
  g_stream_waits.seconds = 0;
}

void set_stream_wait_timing(bool on) {
  g_stream_waits.on.store(on, std::memory_order_relaxed);
  if (!on) stream_wait_seconds();  // folds and drops the events
}

double stream_wait_seconds() {
  std::lock_guard<std::mutex> lock(g_stream_waits.mutex);
  for (CudaTimer& wait : g_stream_waits.waits) g_stream_waits.seconds += wait.seconds();
  g_stream_waits.waits.clear();
  return g_stream_waits.seconds;
}

void Work::State::complete(std::exception_ptr cause) {
  std::function<void()> step;
  {
    std::lock_guard<std::mutex> lock(mutex);
    if (finished || completing) return;
    completing = true;
    step = std::move(finish);
  }
  if (!cause) {
    try {
      if (step) step();
    } catch (...) {
      cause = std::current_exception();
    }
  }
  {
    std::lock_guard<std::mutex> lock(mutex);
    if (cause) error = std::make_exception_ptr(CollectiveError(describe_exception(*this, cause)));
    if (device.is_cuda() && !cause) {
      // Gloo with CUDA tensors: the backend ran the callback on a stream
      // that waits for its copies back; the consumer's stream waits for
      // this event.
      auto event = std::make_shared<c10::Event>(device.type());
      event->record(c10::impl::getDeviceGuardImpl(device.type())->getStream(device));
      done.native = std::move(event);
      if (done.id == 0) done.id = 1;
    }
    completed_us = trace::now_us();
    finished = true;
    backend_work.reset();  // the backend's tensors go as soon as it lets them
  }
  step = nullptr;  // releases the local step's buffers outside the lock
  finished_cv.notify_all();
}

void Work::State::wait_host() {
  std::unique_lock<std::mutex> lock(mutex);
  if (waited) return;
  const int64_t wait_start = trace::now_us();
  if (waiter) {
    // The first waiting thread drives the op to its end (bounded by the
    // group's timeout); any other one waits for it below.
    detail::P2PWaiter drive = std::move(waiter);
    waiter = nullptr;
    lock.unlock();
    std::exception_ptr cause;
    try {
      drive(timeout);
    } catch (...) {
      cause = std::current_exception();
    }
    drive = nullptr;  // the backend's buffers go before the local step
    complete(cause);
    lock.lock();
    if (waited) return;
  }
  finished_cv.wait(lock, [this] { return finished; });
  const int64_t wait_end = trace::now_us();
  waited = true;
  g_stats.comm_us.fetch_add(completed_us - issued_us, std::memory_order_relaxed);
  g_stats.wait_us.fetch_add(wait_end - wait_start, std::memory_order_relaxed);
  if (trace::enabled()) {
    trace::record(trace_name(*this), "comm", op, issued_us, completed_us);
    if (wait_end > wait_start) trace::record(cat("wait ", op), "wait", "wait", wait_start, wait_end);
  }
}

void Work::wait() {
  if (!state_) return;
  // Host-ordered ops have no streams to wait on: no registry lookup per wait.
  wait_on(state_->ops ? state_->ops->current() : StreamRole::kCompute);
}

void Work::wait_on(StreamRole stream) {
  if (!state_) return;
  State& s = *state_;
  // Started before the host waits: while it is blocked, the waiting stream
  // may run dry, and that stall is what the pair measures.
  std::optional<CudaTimer> stall;
  if (s.device.is_cuda() && g_stream_waits.on.load(std::memory_order_relaxed)) {
    stall.emplace(s.device);
    stall->start();
  }
  if (s.host_completion) s.wait_host();
  if (s.error) std::rethrow_exception(s.error);
  if (s.ops && s.done.defined()) {
    // The trace marks the waiting stream before and after its wait: the
    // time it stood still for the collective (dropped when it did not).
    trace::GpuMarkPtr before;
    if (trace::enabled()) before = s.ops->trace_mark(stream);
    s.ops->wait(stream, s.done);
    if (before) {
      trace::record_gpu(cat("wait ", s.op), "wait", "wait", std::move(before),
                        s.ops->trace_mark(stream));
    }
  }
  if (stall) {
    stall->stop();
    std::lock_guard<std::mutex> guard(g_stream_waits.mutex);
    g_stream_waits.waits.push_back(std::move(*stall));
  }
}

StreamEvent Work::event() const { return state_ ? state_->done : StreamEvent{}; }

bool Work::is_completed() const {
  if (!state_) return true;
  if (!state_->host_completion) return !state_->ops || state_->ops->query(state_->done);
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->finished;
}

}  // namespace hp::dist
