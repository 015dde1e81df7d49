// OpProfile (A2's --profile-ops): exact call counts, self time against total
// time for nested ops, threads, that stop() removes its callback, one
// profile per process, allocations per op, and the JSON schema.
#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "hp/util/error.h"
#include "hp/util/memory_stats.h"
#include "hp/util/op_profile.h"

namespace hp {
namespace {

const OpStats* find_op(const OpProfileResult& r, const std::string& name) {
  for (const auto& op : r.ops) {
    if (op.name == name) return &op;
  }
  return nullptr;
}

TEST(OpProfile, CountsEveryCallExactly) {
  const at::Tensor a = at::ones({4});
  OpProfile profile;
  profile.start();
  for (int i = 0; i < 3; ++i) at::add(a, a);
  const OpProfileResult r = profile.stop();
  const OpStats* add = find_op(r, "aten::add");
  ASSERT_NE(add, nullptr) << r.table();
  EXPECT_EQ(add->calls, 3);
  EXPECT_LE(add->self_us, add->total_us);
}

TEST(OpProfile, SelfTimeLeavesOutNestedOps) {
  const at::Tensor x = at::randn({64, 32});
  const at::Tensor w = at::randn({16, 32});
  const at::Tensor b = at::randn({16});
  OpProfile profile;
  profile.start();
  at::linear(x, w, b);  // composite: runs aten::t and aten::addmm inside
  const OpProfileResult r = profile.stop();
  const OpStats* linear = find_op(r, "aten::linear");
  const OpStats* addmm = find_op(r, "aten::addmm");
  ASSERT_NE(linear, nullptr) << r.table();
  ASSERT_NE(addmm, nullptr) << r.table();
  EXPECT_LT(linear->self_us, linear->total_us);
  EXPECT_LE(addmm->total_us, linear->total_us - linear->self_us);
  // Every op ran inside the one top-level linear, so the self times add up
  // to its total: each is a difference of integer nanoseconds, so the sum
  // is exact but for the doubles' rounding of microseconds (far below 1e-6).
  double self_sum = 0;
  for (const auto& op : r.ops) self_sum += op.self_us;
  EXPECT_NEAR(self_sum, linear->total_us, 1e-6);
  EXPECT_LE(linear->total_us, r.wall_us);
}

TEST(OpProfile, CountsUserScopesAndBackwardFunctions) {
  const at::Tensor w = at::randn({8, 8}).requires_grad_(true);
  const at::Tensor x = at::randn({4, 8});
  OpProfile profile;
  profile.start();
  {
    RECORD_USER_SCOPE("hp_test_scope");
    at::mm(x, w).sum().backward();
  }
  const OpProfileResult r = profile.stop();
  const OpStats* scope = find_op(r, "hp_test_scope");
  ASSERT_NE(scope, nullptr) << r.table();
  EXPECT_EQ(scope->calls, 1);
  EXPECT_NE(find_op(r, "MmBackward0"), nullptr) << r.table();  // BACKWARD_FUNCTION scope
  // Autograd ran the backward on this thread, inside the scope: its ops are
  // the scope's children, so their self times and the scope's add up to the
  // scope's total (exact in ns; see SelfTimeLeavesOutNestedOps).
  double self_sum = 0;
  for (const auto& op : r.ops) self_sum += op.self_us;
  EXPECT_NEAR(self_sum, scope->total_us, 1e-6);
}

TEST(OpProfile, CountsOpsOfEveryThread) {
  const at::Tensor a = at::ones({4});
  OpProfile profile;
  profile.start();
  std::vector<std::thread> threads;
  for (int t = 0; t < 2; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 3; ++i) at::add(a, a);
    });
  }
  for (auto& t : threads) t.join();
  at::add(a, a);
  const OpProfileResult r = profile.stop();
  const OpStats* add = find_op(r, "aten::add");
  ASSERT_NE(add, nullptr) << r.table();
  EXPECT_EQ(add->calls, 7);
}

TEST(OpProfile, StopRemovesTheCallback) {
  const bool before = at::hasGlobalCallbacks();
  const at::Tensor a = at::ones({4});
  OpProfile first;
  first.start();
  EXPECT_TRUE(at::hasGlobalCallbacks());
  at::add(a, a);
  const OpProfileResult r = first.stop();
  EXPECT_EQ(at::hasGlobalCallbacks(), before);
  for (int i = 0; i < 5; ++i) at::add(a, a);  // counted by nobody
  OpProfile second;
  second.start();
  at::add(a, a);
  at::add(a, a);
  const OpProfileResult later = second.stop();
  ASSERT_NE(find_op(r, "aten::add"), nullptr);
  EXPECT_EQ(find_op(r, "aten::add")->calls, 1);
  ASSERT_NE(find_op(later, "aten::add"), nullptr);
  EXPECT_EQ(find_op(later, "aten::add")->calls, 2);
}

TEST(OpProfile, RefusesASecondActiveProfile) {
  OpProfile first, second;
  first.start();
  EXPECT_THAT([&] { second.start(); },
              testing::ThrowsMessage<ArgumentError>(testing::HasSubstr("another OpProfile")));
  EXPECT_THAT([&] { first.start(); },
              testing::ThrowsMessage<ArgumentError>(testing::HasSubstr("already active")));
  first.stop();
  EXPECT_THAT([&] { first.stop(); },
              testing::ThrowsMessage<ArgumentError>(testing::HasSubstr("not active")));
  second.start();  // free again
  second.stop();
}

TEST(OpProfile, DestructorStops) {
  {
    OpProfile scoped;
    scoped.start();
  }
  OpProfile next;
  next.start();  // would be refused if the first were still active
  next.stop();
}

TEST(OpProfile, CountsAllocationsPerOpWithMemoryTracking) {
  enable_memory_tracking();
  const at::Tensor a = at::ones({1024});
  OpProfile profile;
  profile.start();
  for (int i = 0; i < 3; ++i) at::add(a, a);  // one output block each
  const OpProfileResult r = profile.stop();
  ASSERT_TRUE(r.allocations_counted);
  double self_allocations = 0;
  for (const auto& op : r.ops) self_allocations += op.self_allocations;
  EXPECT_EQ(self_allocations, 3) << r.table();
  EXPECT_EQ(r.allocations, 3);
}

TEST(OpProfile, PerStepAndJsonSchema) {
  OpProfileResult r;
  r.wall_us = 400;
  r.ops = {OpStats{"aten::mm", 8, 200, 300, 4}, OpStats{"aten::add", 4, 40, 40, 0}};
  const OpProfileResult step = r.per_step(4);
  EXPECT_EQ(step.wall_us, 100);
  EXPECT_EQ(step.ops[0].calls, 2);
  EXPECT_EQ(step.ops[0].self_us, 50);
  EXPECT_EQ(step.ops[0].total_us, 75);
  EXPECT_THROW(r.per_step(0), ArgumentError);

  const nlohmann::json j = nlohmann::json::parse(step.to_json());
  EXPECT_EQ(j["time_unit"], "us");
  EXPECT_TRUE(j["allocations"].is_null());  // not counted
  ASSERT_EQ(j["ops"].size(), 2u);
  EXPECT_EQ(j["ops"][0]["name"], "aten::mm");
  EXPECT_EQ(j["ops"][0]["count"], 2.0);
  EXPECT_EQ(j["ops"][0]["self_cpu_time"], 50.0);
  EXPECT_EQ(j["ops"][0]["cpu_time_total"], 75.0);
  EXPECT_TRUE(j["ops"][0]["self_allocations"].is_null());
  EXPECT_THAT(step.table(1), testing::HasSubstr("aten::mm"));
  EXPECT_THAT(step.table(1), testing::HasSubstr("(1 more ops)"));
}

}  // namespace
}  // namespace hp
