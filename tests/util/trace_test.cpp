// trace::Span: what it records, and that a disabled trace records nothing.
#include <gtest/gtest.h>

#include <string>

#include "hp/util/trace.h"

namespace hp {
namespace {

TEST(TraceSpan, PrefixAndSubjectMakeTheNameWhenTracing) {
  trace::enable(0, "test");
  const std::string unit = "h.0";
  { trace::Span span("unshard ", unit, "fsdp", "compute"); }
  trace::disable();
  const auto events = trace::events();
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].name, "unshard h.0");
  EXPECT_EQ(events[0].category, "fsdp");
  EXPECT_EQ(events[0].lane, "compute");
  EXPECT_LE(events[0].start_us, events[0].end_us);
}

TEST(TraceSpan, RecordsNothingWhileDisabled) {
  trace::enable(0, "test");  // clears earlier events
  trace::disable();
  { trace::Span span("unshard ", std::string("h.0"), "fsdp", "compute"); }
  { trace::Span span(std::string("step 1"), "step", "step"); }
  EXPECT_TRUE(trace::events().empty());
}

}  // namespace
}  // namespace hp
