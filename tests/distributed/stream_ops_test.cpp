// The stream interface and the ordering rules' checker, on logs written by
// hand: the schedule fully_shard had before docs/streams.md (c10d's stream
// sync at every issue, a compute wait per reduce-scatter through a
// continuation, a buffer dropped without a wait) breaks the rules; the
// schedule it runs now keeps them.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <c10/core/Device.h>

#include <memory>

#include "hp/distributed/recording_stream_ops.h"
#include "hp/distributed/stream_ops.h"
#include "tests/support/stream_rules.h"

namespace hp::dist {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using Role = StreamRole;

TEST(StreamOps, TheCpuGetsHostOpsUnlessARecordingIsInstalled) {
  StreamOps& host = stream_ops_for(c10::Device(c10::kCPU));
  EXPECT_FALSE(host.orders_by_streams());
  EXPECT_FALSE(host.record(Role::kCompute, "x").defined()) << "the host records nothing";
  auto recording = std::make_shared<RecordingStreamOps>();
  {
    ScopedStreamOps scope(recording);
    StreamOps& ops = stream_ops_for(c10::Device(c10::kCPU));
    EXPECT_EQ(&ops, recording.get());
    EXPECT_TRUE(ops.orders_by_streams());
  }
  EXPECT_EQ(&stream_ops_for(c10::Device(c10::kCPU)), &host) << "restored after the scope";
}

TEST(StreamOps, ScopesSetAndRestoreTheCurrentStream) {
  RecordingStreamOps ops;
  EXPECT_EQ(ops.current(), Role::kCompute);
  {
    StreamScope copy_in(&ops, Role::kCopyIn);
    EXPECT_EQ(ops.current(), Role::kCopyIn);
    {
      StreamScope gather(&ops, Role::kAllGather);
      EXPECT_EQ(ops.current(), Role::kAllGather);
    }
    EXPECT_EQ(ops.current(), Role::kCopyIn);
  }
  EXPECT_EQ(ops.current(), Role::kCompute);
}

TEST(StreamOps, TheRecordingLogsEveryDecisionInOrder) {
  RecordingStreamOps ops;
  int buffer = 0;
  ops.on_alloc(&buffer, Role::kCopyIn, "all-gather output");
  ops.wait_stream(Role::kAllGather, Role::kCopyIn, "copy in");
  ops.on_collective(Role::kAllGather, "all_gather", 64);
  StreamEvent done = ops.record(Role::kAllGather, "all_gather");
  ops.wait(Role::kCompute, done);
  ops.wait(Role::kCompute, StreamEvent{});  // undefined: complete, not logged
  ops.on_release(&buffer, Role::kCopyIn);
  using Kind = RecordingStreamOps::Kind;
  std::vector<Kind> kinds;
  for (const auto& e : ops.entries()) kinds.push_back(e.kind);
  EXPECT_THAT(kinds, ElementsAre(Kind::kAlloc, Kind::kRecord, Kind::kWait, Kind::kCollective,
                                 Kind::kRecord, Kind::kWait, Kind::kRelease));
  EXPECT_EQ(ops.entries()[5].event, done.id);
  EXPECT_EQ(done.stream, Role::kAllGather);
}

// One unit's forward gather on the streams as fully_shard issues it now,
// with `old_sync` adding what c10d's asyncOp=true did at every issue (the
// communication stream waited for everything queued on compute).
void gather(RecordingStreamOps& ops, int* output, bool old_sync, bool wait_before_release = true) {
  ops.on_alloc(output, Role::kCopyIn, "all-gather output");
  ops.wait_stream(Role::kAllGather, Role::kCopyIn, "copy in");
  if (old_sync) ops.wait_stream(Role::kAllGather, Role::kCompute, "all_gather issue");
  ops.on_use(output, Role::kAllGather);
  ops.on_collective(Role::kAllGather, "all_gather", 64);
  StreamEvent done = ops.record(Role::kAllGather, "all_gather");
  ops.wait(Role::kCompute, done);
  ops.on_use(output, Role::kCompute);
  StreamEvent copy_out = ops.record(Role::kCompute, "copy out");
  if (wait_before_release) ops.wait(Role::kCopyIn, copy_out);
  ops.on_release(output, Role::kCopyIn);
}

// One unit's reduce-scatter; `old_continuation` adds the compute wait that
// Work::then() made right after the issue.
void reduce(RecordingStreamOps& ops, int* input, bool old_continuation) {
  ops.on_alloc(input, Role::kCompute, "reduce-scatter input");
  ops.wait_stream(Role::kReduceScatter, Role::kCompute, "pack done");
  ops.on_use(input, Role::kReduceScatter);
  ops.on_collective(Role::kReduceScatter, "reduce_scatter", 64);
  StreamEvent done = ops.record(Role::kReduceScatter, "reduce_scatter");
  if (old_continuation) ops.wait(Role::kCompute, done);
  ops.on_mark("end of backward");
  ops.wait(Role::kCompute, done);
  ops.on_release(input, Role::kCompute);
}

TEST(StreamRules, TheCurrentScheduleKeepsThem) {
  RecordingStreamOps ops;
  int a = 0, b = 0, g = 0;
  ops.on_mark("iteration start");
  ops.wait_stream(Role::kCopyIn, Role::kCompute, "iteration start");
  gather(ops, &a, /*old_sync=*/false);
  gather(ops, &b, /*old_sync=*/false);
  reduce(ops, &g, /*old_continuation=*/false);
  EXPECT_THAT(test::check_stream_rules(ops.entries()), IsEmpty());
}

TEST(StreamRules, CatchAStreamSyncAtEveryGather) {
  RecordingStreamOps ops;
  int a = 0;
  gather(ops, &a, /*old_sync=*/true);
  const auto broken = test::check_stream_rules(ops.entries());
  ASSERT_EQ(broken.size(), 1u);
  EXPECT_THAT(broken[0], HasSubstr("gather waits: all_gather waits compute's 'all_gather issue'"));
}

TEST(StreamRules, CatchAComputeWaitAtEveryReduceScatter) {
  RecordingStreamOps ops;
  int g = 0;
  reduce(ops, &g, /*old_continuation=*/true);
  const auto broken = test::check_stream_rules(ops.entries());
  ASSERT_EQ(broken.size(), 1u);
  EXPECT_THAT(broken[0], HasSubstr("compute waits: compute waits reduce_scatter's"));
}

TEST(StreamRules, CatchABufferReleasedBeforeItsLastUseElsewhere) {
  RecordingStreamOps ops;
  int a = 0;
  gather(ops, &a, /*old_sync=*/false, /*wait_before_release=*/false);
  // Neither the gather's read nor the copy-out is ordered before it.
  const auto broken = test::check_stream_rules(ops.entries());
  ASSERT_EQ(broken.size(), 2u);
  EXPECT_THAT(broken[0], HasSubstr("is released on copy_in before it is ordered after its use "
                                   "on all_gather"));
  EXPECT_THAT(broken[1], HasSubstr("is released on copy_in before it is ordered after its use "
                                   "on compute"));
}

TEST(StreamRules, CatchAReleaseOnAnotherStreamAndBuffersLeftOrPiledUp) {
  RecordingStreamOps ops;
  int a = 0, b = 0, c = 0;
  ops.on_alloc(&a, Role::kCopyIn, "all-gather output");
  ops.on_release(&a, Role::kCompute);
  for (int* input : {&a, &b, &c}) ops.on_alloc(input, Role::kCompute, "reduce-scatter input");
  ops.on_alloc(&b + 1, Role::kCopyIn, "all-gather output");  // never released
  const auto broken = test::check_stream_rules(ops.entries(), /*rs_input_cap=*/1);
  ASSERT_EQ(broken.size(), 3u);
  EXPECT_THAT(broken[0], HasSubstr("allocated on copy_in is released on compute"));
  EXPECT_THAT(broken[1], HasSubstr("3 reduce-scatter inputs allocated at once (at most 2)"));
  EXPECT_THAT(broken[2], HasSubstr("never released"));
}

TEST(StreamRules, CatchAnAllReduceThatWaitsCompute) {
  RecordingStreamOps ops;
  ops.wait_stream(Role::kAllReduce, Role::kCompute, "pack done");
  const auto broken = test::check_stream_rules(ops.entries());
  ASSERT_EQ(broken.size(), 1u);
  EXPECT_THAT(broken[0], HasSubstr("all-reduce stream waits compute"));
}

TEST(StreamOverlap, AGatherRunsBesideTheForwardQueuedBeforeIt) {
  // The CPU queued unit k's forward, then issues unit k+1's gather: on its
  // own streams it runs beside that forward; with c10d's sync at every
  // issue it waits for it, and nothing overlaps.
  for (bool old_sync : {false, true}) {
    RecordingStreamOps ops;
    ops.on_mark("compute forward of unit k");
    ops.wait_stream(Role::kAllGather, Role::kCopyIn, "copy in");
    if (old_sync) ops.wait_stream(Role::kAllGather, Role::kCompute, "all_gather issue");
    ops.on_collective(Role::kAllGather, "all_gather", 64);
    StreamEvent done = ops.record(Role::kAllGather, "all_gather");
    ops.wait(Role::kCompute, done);
    ops.on_mark("compute forward of unit k+1");
    const test::StreamOverlap overlap = test::simulate_overlap(ops.entries());
    EXPECT_DOUBLE_EQ(overlap.comm_hidden, old_sync ? 0.0 : 1.0) << "old sync " << old_sync;
    EXPECT_DOUBLE_EQ(overlap.makespan, old_sync ? 3.0 : 2.0) << "old sync " << old_sync;
  }
}

}  // namespace
}  // namespace hp::dist
