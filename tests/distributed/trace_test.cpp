// The trace of collectives that run on a stream (hp/util/gpu_trace.h), on
// the CPU: recording ops whose trace marks are fake GPU marks (the device
// clock advances 1 ms per mark) stand for CUDA's streams, and a group of one
// rank runs its collectives on the issuing stream, as NCCL does. With the
// host's ops (Gloo) the trace of the same calls stays what it was: host
// spans only.
#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "hp/distributed/collectives.h"
#include "hp/distributed/recording_stream_ops.h"
#include "hp/distributed/stream_ops.h"
#include "hp/distributed/world.h"
#include "hp/util/gpu_trace.h"
#include "hp/util/trace.h"
#include "tests/support/clock_gpu_mark.h"

namespace hp::dist {
namespace {

using ::testing::ElementsAre;
using ::testing::IsEmpty;

using test::ClockMark;  // fake GPU marks on a device clock

// The recording ops, marking each stream for the trace; `marks` counts them.
class MarkingStreamOps final : public RecordingStreamOps {
 public:
  std::shared_ptr<trace::GpuMark> trace_mark(StreamRole stream) override {
    ++marks;
    device_ms_ += 1.0;
    return std::make_shared<ClockMark>(device_ms_);
  }
  int marks = 0;

 private:
  double device_ms_ = 0;
};

// This rank's group of one (every rank makes every rank's, in order).
GroupPtr own_group() {
  GroupPtr mine;
  for (int r = 0; r < get_world_size(); ++r) {
    GroupPtr g = new_group({r});
    if (r == get_rank()) mine = g;
  }
  return mine;
}

struct Lanes {
  std::vector<std::string> host, gpu;  // "name @ lane"
};

Lanes traced(const std::vector<trace::Event>& events) {
  Lanes out;
  for (const trace::Event& e : events) {
    const bool gpu = e.lane.rfind("gpu ", 0) == 0;
    (gpu ? out.gpu : out.host).push_back(e.name + " @ " + e.lane);
  }
  return out;
}

TEST(TraceOnStreams, ACollectiveOnItsStreamIsTimedThereBesideTheHostsIssue) {
  GroupPtr group = own_group();
  const std::string name = "all_gather " + group->describe() + " #" +
                           std::to_string(group->sequence_number());
  auto ops = std::make_shared<MarkingStreamOps>();
  ScopedStreamOps scope(ops);
  trace::enable(get_rank(), "test");
  trace::anchor_gpu(ops->trace_mark(StreamRole::kCompute), trace::now_us());
  at::Tensor input = at::ones({4}), output = at::empty({4});
  Work work;
  {
    StreamScope on(ops.get(), StreamRole::kAllGather);
    work = all_gather_into(*group, output, input);
  }
  work.wait();  // from the compute stream, which stands still for it
  trace::disable();
  EXPECT_EQ(trace::pending_gpu_spans(), 2u) << "nothing resolves before it is asked";
  trace::resolve_gpu();
  const Lanes lanes = traced(trace::events());
  EXPECT_THAT(lanes.host, ElementsAre("issue " + name + " @ all_gather"));
  EXPECT_THAT(lanes.gpu,
              ElementsAre(name + " @ gpu all_gather", "wait all_gather @ gpu wait"));
  for (const trace::Event& e : trace::events()) {
    if (e.lane == "gpu all_gather") {
      // Marks 2 and 3 of the device clock, after the anchor (mark 1).
      EXPECT_EQ(e.end_us - e.start_us, 1000) << "the span pairs its own two marks";
      EXPECT_EQ(e.category, "comm");
    }
  }
  EXPECT_EQ(ops->marks, 5) << "anchor, the collective's two, the wait's two";
  EXPECT_TRUE(at::equal(output, input));
}

TEST(TraceOnStreams, UntracedCollectivesMakeNoMarks) {
  GroupPtr group = own_group();
  auto ops = std::make_shared<MarkingStreamOps>();
  ScopedStreamOps scope(ops);
  trace::enable(get_rank(), "test");
  trace::disable();
  at::Tensor input = at::ones({4}), output = at::empty({4});
  all_gather_into(*group, output, input).wait();
  EXPECT_EQ(ops->marks, 0);
  EXPECT_THAT(trace::events(), IsEmpty());
}

// Gloo on the world, host ops: what the trace showed before GPU spans, the
// collective from issue to completion and the host's wait, and nothing else.
TEST(TraceOnStreams, TheHostsCollectivesKeepTheirHostSpansOnly) {
  GroupPtr world = world_group();
  trace::enable(get_rank(), "test");
  at::Tensor t = at::ones({4});
  all_reduce(*world, t).wait();
  trace::disable();
  trace::resolve_gpu(/*wait=*/true);
  const Lanes lanes = traced(trace::events());
  EXPECT_THAT(lanes.gpu, IsEmpty());
  ASSERT_FALSE(lanes.host.empty());
  EXPECT_EQ(lanes.host[0].rfind("all_reduce " + world->describe() + " #", 0), 0u)
      << lanes.host[0];
  for (const trace::Event& e : trace::events()) {
    EXPECT_TRUE(e.lane == "all_reduce" || e.lane == "wait") << e.name << " @ " << e.lane;
  }
}

}  // namespace
}  // namespace hp::dist
