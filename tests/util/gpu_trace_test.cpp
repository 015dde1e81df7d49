// The trace's GPU spans (hp/util/gpu_trace.h) with fake marks: a fake
// device whose marks carry the device time the test gives them, reached when
// the test says. What a CUDA run depends on and no CPU machine can run: each
// span pairs its two marks and lands on the host timeline through the
// anchor latest at its recording; nothing converts before the device
// reached it, and only the final write waits for the device; GPU spans get
// lanes of their own, after the host's.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include "hp/util/gpu_trace.h"
#include "hp/util/trace.h"

namespace hp::trace {
namespace {

using ::testing::ElementsAre;

// What the fake device counts: every host wait and every query.
struct FakeDevice {
  int syncs = 0;
  int queries = 0;
};

class FakeMark final : public GpuMark {
 public:
  FakeMark(FakeDevice& device, double device_ms, bool reached)
      : device_(device), ms_(device_ms), reached_(reached) {}
  bool reached() override {
    ++device_.queries;
    return reached_;
  }
  void synchronize() override {
    ++device_.syncs;
    reached_ = true;
  }
  double milliseconds_to(GpuMark& later) override {
    auto& other = static_cast<FakeMark&>(later);
    // A real device cannot time a mark it has not reached (CUDA raises).
    EXPECT_TRUE(reached_ && other.reached_) << "elapsed time of a mark not reached";
    return other.ms_ - ms_;
  }
  void reach() { reached_ = true; }

 private:
  FakeDevice& device_;
  double ms_;
  bool reached_;
};

std::shared_ptr<FakeMark> mark(FakeDevice& device, double ms, bool reached = true) {
  return std::make_shared<FakeMark>(device, ms, reached);
}

struct Span {
  std::string name, lane;
  int64_t start_us, end_us;
  bool operator==(const Span& o) const {
    return name == o.name && lane == o.lane && start_us == o.start_us && end_us == o.end_us;
  }
  friend std::ostream& operator<<(std::ostream& os, const Span& s) {
    return os << s.name << " [" << s.lane << "] " << s.start_us << ".." << s.end_us;
  }
};

std::vector<Span> spans(const std::vector<Event>& events) {
  std::vector<Span> out;
  for (const Event& e : events) out.push_back({e.name, e.lane, e.start_us, e.end_us});
  return out;
}

TEST(GpuTimeline, ASpanLandsOnTheHostTimelineThroughTheAnchor) {
  FakeDevice gpu;
  GpuTimeline timeline;
  std::vector<Event> out;
  // The device stood at 1000 ms when the host read 5000 us.
  timeline.anchor(mark(gpu, 1000.0), 5000);
  ASSERT_TRUE(timeline.add("forward h.0", "compute", "compute", mark(gpu, 1000.5),
                           mark(gpu, 1000.75), out));
  timeline.resolve(/*wait=*/false, out);
  EXPECT_THAT(spans(out), ElementsAre(Span{"forward h.0", "gpu compute", 5500, 5750}));
  EXPECT_EQ(out[0].category, "compute");
  EXPECT_EQ(timeline.pending(), 0u);
}

TEST(GpuTimeline, NothingConvertsBeforeTheDeviceReachedItAndOnlyTheFinalResolveWaits) {
  FakeDevice gpu;
  GpuTimeline timeline;
  std::vector<Event> out;
  timeline.anchor(mark(gpu, 0.0), 0);
  auto gather_start = mark(gpu, 1.0, false), gather_end = mark(gpu, 3.0, false);
  auto forward_start = mark(gpu, 2.0, false), forward_end = mark(gpu, 4.0, false);
  timeline.add("all_gather world #0", "comm", "all_gather", gather_start, gather_end, out);
  timeline.add("forward h.0", "compute", "compute", forward_start, forward_end, out);
  EXPECT_TRUE(out.empty()) << "recording converts nothing";

  timeline.resolve(/*wait=*/false, out);
  EXPECT_TRUE(out.empty()) << "neither span was reached";
  EXPECT_EQ(timeline.pending(), 2u);

  // The gather ran; the forward has started but not ended.
  gather_start->reach();
  gather_end->reach();
  forward_start->reach();
  timeline.resolve(/*wait=*/false, out);
  EXPECT_THAT(spans(out), ElementsAre(Span{"all_gather world #0", "gpu all_gather", 1000, 3000}));
  EXPECT_EQ(timeline.pending(), 1u);
  EXPECT_EQ(gpu.syncs, 0) << "no host wait while recording or resolving lazily";

  timeline.resolve(/*wait=*/true, out);
  EXPECT_THAT(spans(out), ElementsAre(Span{"all_gather world #0", "gpu all_gather", 1000, 3000},
                                      Span{"forward h.0", "gpu compute", 2000, 4000}));
  EXPECT_GT(gpu.syncs, 0) << "the final resolve waits for the device";
  EXPECT_EQ(timeline.pending(), 0u);
}

TEST(GpuTimeline, EachSpanConvertsWithTheAnchorLatestWhenItWasRecorded) {
  FakeDevice gpu;
  GpuTimeline timeline;
  std::vector<Event> out;
  timeline.anchor(mark(gpu, 100.0), 1000);
  timeline.add("step 0 forward", "compute", "compute", mark(gpu, 101.0, false),
               mark(gpu, 102.0, false), out);
  // The next step's anchor: the device clock drifted 50 us against the host's.
  timeline.anchor(mark(gpu, 200.0), 101050);
  timeline.add("step 1 forward", "compute", "compute", mark(gpu, 201.0), mark(gpu, 202.0), out);
  timeline.resolve(/*wait=*/true, out);
  EXPECT_THAT(spans(out), ElementsAre(Span{"step 0 forward", "gpu compute", 2000, 3000},
                                      Span{"step 1 forward", "gpu compute", 102050, 103050}));
}

TEST(GpuTimeline, KeepsNothingWithoutAnAnchorOrAMark) {
  FakeDevice gpu;
  GpuTimeline timeline;
  std::vector<Event> out;
  EXPECT_FALSE(timeline.add("forward h.0", "compute", "compute", mark(gpu, 1), mark(gpu, 2), out))
      << "no anchor: nothing to convert against";
  timeline.anchor(mark(gpu, 0), 0);
  EXPECT_FALSE(timeline.add("forward h.0", "compute", "compute", mark(gpu, 1), nullptr, out))
      << "a libtorch that cannot time events gives no mark";
  EXPECT_EQ(timeline.pending(), 0u);
}

TEST(GpuTimeline, AStreamThatDidNotStandStillLeavesNoWaitSpan) {
  FakeDevice gpu;
  GpuTimeline timeline;
  std::vector<Event> out;
  timeline.anchor(mark(gpu, 0), 0);
  timeline.add("wait all_gather", "wait", "wait", mark(gpu, 1), mark(gpu, 1), out);
  timeline.add("wait reduce_scatter", "wait", "wait", mark(gpu, 2), mark(gpu, 2.5), out);
  timeline.add("forward h.0", "compute", "compute", mark(gpu, 3), mark(gpu, 3), out);
  timeline.resolve(/*wait=*/false, out);
  EXPECT_THAT(spans(out), ElementsAre(Span{"wait reduce_scatter", "gpu wait", 2000, 2500},
                                      Span{"forward h.0", "gpu compute", 3000, 3000}));
}

TEST(GpuTimeline, ManyUnresolvedSpansResolveThoseReachedWithoutWaiting) {
  FakeDevice gpu;
  GpuTimeline timeline;
  std::vector<Event> out;
  timeline.anchor(mark(gpu, 0), 0);
  for (size_t i = 0; i + 1 < GpuTimeline::kResolveAt; ++i) {
    timeline.add("wait", "comm", "all_gather", mark(gpu, 1), mark(gpu, 2), out);
  }
  EXPECT_TRUE(out.empty());
  timeline.add("last", "comm", "all_gather", mark(gpu, 3), mark(gpu, 4, false), out);
  EXPECT_EQ(out.size(), GpuTimeline::kResolveAt - 1);
  EXPECT_EQ(timeline.pending(), 1u) << "the one the device has not reached stays";
  EXPECT_EQ(gpu.syncs, 0);
}

// The process-wide trace: recording keeps marks, write() converts them into
// lanes of their own beside the host's.
TEST(GpuTrace, WriteWaitsOnceAndPutsGpuSpansInLanesAfterTheHosts) {
  FakeDevice gpu;
  enable(3, "rank 3");
  const int64_t now = now_us();
  anchor_gpu(mark(gpu, 50.0), now);
  record("forward h.0", "compute", "compute", now, now + 10);
  record("all_gather world #0", "comm", "all_gather", now, now + 5);
  record_gpu("forward h.0", "compute", "compute", mark(gpu, 51.0, false), mark(gpu, 52.0, false));
  record_gpu("all_gather world #0", "comm", "all_gather", mark(gpu, 50.5, false),
             mark(gpu, 50.75, false));
  EXPECT_EQ(pending_gpu_spans(), 2u);
  EXPECT_EQ(events().size(), 2u) << "only the host spans until the device is asked";
  disable();

  const std::string path = (std::filesystem::temp_directory_path() /
                            ("hp_gpu_trace_" + std::to_string(::getpid()) + ".json"))
                               .string();
  write(path);
  EXPECT_EQ(pending_gpu_spans(), 0u);
  EXPECT_GT(gpu.syncs, 0);
  std::ifstream in(path);
  const auto document = nlohmann::json::parse(in);
  std::filesystem::remove(path);

  std::map<int, std::string> lane_of_tid;
  std::map<std::string, int64_t> gpu_start;
  for (const auto& e : document["traceEvents"]) {
    if (e["ph"] == "M" && e["name"] == "thread_name") {
      lane_of_tid[e["tid"].get<int>()] = e["args"]["name"].get<std::string>();
    }
  }
  std::vector<std::string> lanes;
  for (const auto& [tid, lane] : lane_of_tid) lanes.push_back(lane);
  EXPECT_THAT(lanes, ElementsAre("compute", "all_gather", "gpu compute", "gpu all_gather"));
  for (const auto& e : document["traceEvents"]) {
    if (e["ph"] != "X") continue;
    EXPECT_EQ(e["pid"], 3);
    const std::string lane = lane_of_tid.at(e["tid"].get<int>());
    if (lane.rfind("gpu ", 0) == 0) gpu_start[e["name"].get<std::string>()] = e["ts"];
  }
  EXPECT_EQ(gpu_start.at("forward h.0"), now + 1000);
  EXPECT_EQ(gpu_start.at("all_gather world #0"), now + 500);
}

TEST(GpuTrace, RecordsNothingWhileDisabled) {
  FakeDevice gpu;
  enable(0, "test");  // clears earlier spans and anchors
  disable();
  anchor_gpu(mark(gpu, 0), 0);
  record_gpu("forward h.0", "compute", "compute", mark(gpu, 1), mark(gpu, 2));
  EXPECT_EQ(pending_gpu_spans(), 0u);
  resolve_gpu(/*wait=*/true);
  EXPECT_TRUE(events().empty());
  EXPECT_EQ(gpu.syncs, 0);
}

}  // namespace
}  // namespace hp::trace
