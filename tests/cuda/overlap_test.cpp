// Overlap on a GPU, from CUDA event timestamps: with comm_fusion over NCCL
// (2 or more ranks), the all-gather of unit k+1 runs while unit k's forward
// computes, and the reduce-scatter of unit k while unit k-1's backward
// computes (docs/streams.md: the all-gather and reduce-scatter streams run
// beside the compute stream, which waits only for what it needs).
//
// How it is measured. The device's StreamOps are wrapped (ScopedStreamOps
// for a CUDA device) by ops that forward every call and add timing events:
// on a collective's stream just before it is issued (after the stream's
// waits for its inputs) and just after it (its completion event), so the
// interval is the collective itself. The units' compute is marked on the
// compute stream by hooks that run after fully_shard's: a block's forward
// from after its copy-out to its end, its backward from after its
// pre-backward unshard to its input's gradient. The intervals are the
// GPU's times; the test asserts that the intervals intersect, never a
// duration. Gloo runs collectives on its own threads, not on the streams:
// skipped there.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <c10/core/Event.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <deque>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <vector>

#include "hp/distributed/group.h"
#include "hp/distributed/stream_ops.h"
#include "hp/distributed/world.h"
#include "hp/fsdp/fully_shard.h"
#include "hp/nn/gpt.h"
#include "hp/nn/loss.h"
#include "hp/util/torch_compat.h"
#include "tests/cuda/gpt_parity.h"
#include "tests/cuda/on_cuda.h"
#include "tests/support/model_configs.h"

namespace hp::cuda_test {
namespace {

using dist::StreamEvent;
using dist::StreamRole;

// A CUDA device's StreamOps with timing marks added (see the file comment).
class TimingStreamOps final : public dist::StreamOps {
 public:
  struct Span {
    StreamRole stream;
    std::string op;
    int start = -1, end = -1;  // marks
  };

  TimingStreamOps(dist::StreamOps& inner, c10::Device device) : inner_(inner), device_(device) {}

  // A timing event on the calling thread's current stream; its index.
  int mark() {
    std::lock_guard<std::mutex> lock(mutex_);
    return mark_locked();
  }

  // Drops every mark and span (between iterations).
  void clear() {
    std::lock_guard<std::mutex> lock(mutex_);
    events_.clear();
    spans_.clear();
    for (auto& open : open_) open = -1;
  }

  // Waits for every mark; milliseconds from mark 0 to each.
  std::vector<double> times() {
    std::lock_guard<std::mutex> lock(mutex_);
    std::vector<double> out;
#if HP_TORCH_AT_LEAST(2, 11)
    for (auto& event : events_) event.synchronize();
    for (auto& event : events_) out.push_back(events_.front().elapsedTime(event));
#endif
    return out;
  }

  std::vector<Span> spans(StreamRole stream, const std::string& op) {
    std::lock_guard<std::mutex> lock(mutex_);
    std::vector<Span> out;
    for (const Span& s : spans_) {
      if (s.stream == stream && s.op == op && s.end >= 0) out.push_back(s);
    }
    return out;
  }

  bool orders_by_streams() const override { return inner_.orders_by_streams(); }
  void begin_iteration() override { inner_.begin_iteration(); }
  StreamRole current() const override { return inner_.current(); }
  StreamRole set_current(StreamRole role) override { return inner_.set_current(role); }
  StreamEvent record(StreamRole stream, const char* tag) override {
    StreamEvent event = inner_.record(stream, tag);
    std::lock_guard<std::mutex> lock(mutex_);
    // The first record on a collective's stream after it is its completion
    // event (Work's, after the collective and its local step).
    int& open = open_[static_cast<size_t>(stream)];
    if (open >= 0 && stream == inner_.current()) {
      spans_[static_cast<size_t>(open)].end = mark_locked();
      open = -1;
    }
    return event;
  }
  void wait(StreamRole waiter, const StreamEvent& event) override { inner_.wait(waiter, event); }
  void host_wait(const StreamEvent& event) override { inner_.host_wait(event); }
  bool query(const StreamEvent& event) override { return inner_.query(event); }
  void on_alloc(const void* buffer, StreamRole stream, const char* what) override {
    inner_.on_alloc(buffer, stream, what);
  }
  void on_use(const void* buffer, StreamRole stream) override { inner_.on_use(buffer, stream); }
  void on_release(const void* buffer, StreamRole stream) override {
    inner_.on_release(buffer, stream);
  }
  void on_collective(StreamRole stream, const char* op, int64_t bytes) override {
    inner_.on_collective(stream, op, bytes);
    if (stream != inner_.current()) return;  // issued elsewhere: not on this thread's stream
    std::lock_guard<std::mutex> lock(mutex_);
    spans_.push_back({stream, op, mark_locked(), -1});
    open_[static_cast<size_t>(stream)] = static_cast<int>(spans_.size()) - 1;
  }
  void on_mark(const char* what) override { inner_.on_mark(what); }

 private:
  int mark_locked() {
    // BACKEND_DEFAULT: a CUDA event that keeps its timestamp.
    events_.emplace_back(c10::DeviceType::CUDA, c10::EventFlag::BACKEND_DEFAULT);
    events_.back().record(c10::impl::getDeviceGuardImpl(device_.type())->getStream(device_));
    return static_cast<int>(events_.size()) - 1;
  }

  dist::StreamOps& inner_;
  const c10::Device device_;
  std::mutex mutex_;
  std::deque<c10::Event> events_;
  std::vector<Span> spans_;
  std::array<int, dist::kStreamRoleCount> open_{-1, -1, -1, -1, -1};
};

struct Interval {
  double start, end;
};

std::string describe(const Interval& i) {
  std::ostringstream out;
  out << "[" << i.start << ", " << i.end << "] ms";
  return out.str();
}

testing::AssertionResult intersect(const Interval& a, const Interval& b) {
  if (std::max(a.start, b.start) < std::min(a.end, b.end)) return testing::AssertionSuccess();
  return testing::AssertionFailure() << describe(a) << " and " << describe(b) << " are disjoint";
}

TEST_F(OnCuda, CollectivesOverlapTheNeighbouringUnitsCompute) {
  if (dist::get_world_size() < 2) GTEST_SKIP() << "a world of one communicates nothing";
  if (mesh_->backend_type() != dist::BackendType::kNccl) {
    GTEST_SKIP() << "Gloo runs collectives on its threads, not on the streams";
  }
#if !HP_TORCH_AT_LEAST(2, 11)
  GTEST_SKIP() << "CUDA event timing needs libtorch 2.11 or later";
#endif
  auto timing = std::make_shared<TimingStreamOps>(dist::stream_ops_for(device_), device_);
  dist::ScopedStreamOps installed(timing, device_);
  // Everything that holds the ops (the tree's context, Works) lives in this
  // scope, inside the installation's.
  constexpr int64_t kLayers = 4;
  std::vector<int> fwd_start(kLayers, -1), fwd_end(kLayers, -1), bwd_start(kLayers, -1),
      bwd_end(kLayers, -1);
  size_t forward_all_gathers = 0;
  {
    // Blocks large enough that a gather (about 3 MiB each) and a block's
    // kernels are each many microseconds of GPU time.
    torch::manual_seed(5);
    nn::GPT model(test::gpt_config(
        {/*vocab=*/256, /*context=*/64, kLayers, /*heads=*/4, /*width=*/256}));
    model->to(device_);
    FullyShardOptions options;
    options.mesh = mesh_;
    options.comm_fusion = true;
    FSDPModule root = shard_gpt(model, options);
    const auto blocks = model->blocks();
    for (int64_t j = 0; j < kLayers; ++j) {
      nn::Block block = blocks.at(static_cast<size_t>(j));
      // Registered after fully_shard's hooks, so they run after them.
      block->register_forward_pre_hook(
          [&, j](nn::Module&, const nn::TensorList& inputs) -> std::optional<nn::TensorList> {
            fwd_start[j] = timing->mark();
            // A view of the input, whose gradient is the block's last
            // backward result: its hook marks the end of the block's
            // backward, before the previous block's pre-backward runs.
            at::Tensor x = inputs.at(0).view_as(inputs.at(0));
            x.register_hook([&, j](const at::Tensor&) { bwd_end[j] = timing->mark(); });
            nn::TensorList replaced = inputs;
            replaced[0] = x;
            return replaced;
          });
      block->register_forward_hook(
          [&, j](nn::Module&, const nn::TensorList&,
                 const nn::TensorList& outputs) -> std::optional<nn::TensorList> {
            fwd_end[j] = timing->mark();
            // After fully_shard's pre-backward hook on the same tensor.
            outputs.at(0).register_hook([&, j](const at::Tensor&) { bwd_start[j] = timing->mark(); });
            return std::nullopt;
          });
    }
    at::Tensor tokens = at::randint(256, {8, 65}, at::detail::createCPUGenerator(13), at::kLong)
                            .to(device_);
    // The first iteration records the units' order, which the second's
    // prefetching follows: the second is measured.
    for (int iteration = 0; iteration < 2; ++iteration) {
      timing->clear();
      at::Tensor loss = nn::cross_entropy(model(tokens.narrow(1, 0, 64)), tokens.narrow(1, 1, 64));
      forward_all_gathers = timing->spans(StreamRole::kAllGather, "all_gather").size();
      loss.backward();
      root.zero_grad();
      EXPECT_TRUE(std::isfinite(loss.item<double>()));
    }
  }
  const std::vector<double> t = timing->times();
  for (int64_t j = 0; j < kLayers; ++j) {
    ASSERT_TRUE(fwd_start[j] >= 0 && fwd_end[j] >= 0 && bwd_start[j] >= 0 && bwd_end[j] >= 0)
        << "a hook of block " << j << " did not run";
  }
  auto interval = [&](int from, int to) {
    return Interval{t.at(static_cast<size_t>(from)), t.at(static_cast<size_t>(to))};
  };

  // The forward's all-gathers, in issue order: the root's (when it was
  // resharded), then block 0, ..., block L-1.
  std::vector<TimingStreamOps::Span> gathers = timing->spans(StreamRole::kAllGather, "all_gather");
  ASSERT_GE(forward_all_gathers, static_cast<size_t>(kLayers)) << "one gather a block in forward";
  const size_t first_block = forward_all_gathers - kLayers;
  for (int64_t k = 0; k + 1 < kLayers; ++k) {
    SCOPED_TRACE("all-gather of block " + std::to_string(k + 1) + ", forward of block " +
                 std::to_string(k));
    const TimingStreamOps::Span& gather = gathers.at(first_block + k + 1);
    EXPECT_TRUE(intersect(interval(gather.start, gather.end), interval(fwd_start[k], fwd_end[k])));
  }

  // The backward's reduce-scatters, in issue order: block L-1, ..., block
  // 0, then the root (one each: comm_fusion).
  std::vector<TimingStreamOps::Span> reductions =
      timing->spans(StreamRole::kReduceScatter, "reduce_scatter");
  ASSERT_EQ(reductions.size(), static_cast<size_t>(kLayers + 1)) << "one a unit";
  for (int64_t k = kLayers - 1; k >= 1; --k) {
    SCOPED_TRACE("reduce-scatter of block " + std::to_string(k) + ", backward of block " +
                 std::to_string(k - 1));
    const TimingStreamOps::Span& reduction = reductions.at(static_cast<size_t>(kLayers - 1 - k));
    EXPECT_TRUE(intersect(interval(reduction.start, reduction.end),
                          interval(bwd_start[k - 1], bwd_end[k - 1])));
  }
}

}  // namespace
}  // namespace hp::cuda_test
