// Errors of the collectives facade (D3, D5): local argument errors are
// raised before anything reaches the wire; cross-rank mismatches (with
// checks on) and timeouts become CollectiveErrors that name the op, the
// group's ranks, the sizes and the sequence number.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <chrono>
#include <thread>

#include "hp/dist/collective_checks.h"
#include "hp/dist/collectives.h"
#include "hp/dist/world.h"
#include "hp/util/error.h"
#include "tests/support/tensor_checks.h"
#include "tests/support/text_checks.h"

namespace hp::dist {
namespace {

using test::contains;

TEST(CollectiveErrors, LocalArgumentErrorsNameTheProblem) {
  Group& g = *world_group();
  const int n = g.size();
  auto error = [](auto fn) { return test::message_of<ArgumentError>(fn); };

  std::string m = error([&] { all_gather_into(g, at::empty({n * 3 + 1}), at::ones({3})); });
  EXPECT_TRUE(contains(m, "all_gather: output [" + std::to_string(n * 3 + 1) + "]")) << m;
  EXPECT_TRUE(contains(m, "must have group size " + std::to_string(n))) << m;

  m = error([&] { all_gather_into(g, at::empty({n * 2, 2}).t(), at::ones({2})); });
  EXPECT_TRUE(contains(m, "output") && contains(m, "must be contiguous")) << m;

  m = error([&] { all_gather_into(g, at::empty({n}, at::kDouble), at::ones({1})); });
  EXPECT_TRUE(contains(m, "output dtype Double differs from input dtype Float")) << m;

  m = error([&] { reduce_scatter(g, at::empty({2}), at::ones({n * 2 + 1})); });
  EXPECT_TRUE(contains(m, "reduce_scatter: input [" + std::to_string(n * 2 + 1) + "]")) << m;

  m = error([&] { all_reduce(g, at::ones({2}, at::kLong), ReduceOp::kAvg); });
  EXPECT_TRUE(contains(m, "reduce op 'avg' needs a floating-point tensor, got Long")) << m;

  m = error([&] { broadcast(g, at::ones({2}), n); });
  EXPECT_TRUE(contains(m, "broadcast: source " + std::to_string(n) + " is not a group rank")) << m;

  m = error([&] {
    std::vector<int64_t> splits(n, 1);
    splits[0] = 5;
    all_to_all(g, at::empty({n}), at::ones({n}), {}, splits);
  });
  EXPECT_TRUE(contains(m, "input_splits") && contains(m, "sum to")) << m;

  m = error([&] { all_to_all(g, at::empty({2 * n, 3}), at::ones({n, 3})); });
  EXPECT_TRUE(contains(m, "all_to_all: with equal splits output [" + std::to_string(2 * n) +
                              ", 3] Float (" + std::to_string(6 * n) + " elements) and input [" +
                              std::to_string(n) + ", 3] Float (" + std::to_string(3 * n) +
                              " elements) must have the same number of elements"))
      << m;

  m = error([&] { all_reduce(g, at::Tensor()); });
  EXPECT_TRUE(contains(m, "tensor is an undefined tensor")) << m;

  m = error([] { parse_reduce_op("prod"); });
  EXPECT_TRUE(contains(m, "reduce_op must be one of ['sum', 'avg', 'max', 'min'] but got 'prod'"))
      << m;
  // Nothing above reached the wire: the group is still in step.
  at::Tensor t = at::ones({1});
  all_reduce(g, t).wait();
  EXPECT_EQ(t.item<float>(), float(n));
}

TEST(CollectiveErrors, MismatchedSizesAreReportedOnEveryRankWithChecks) {
  Group& g = *world_group();
  set_collective_checks(true);
  // Rank 0 gathers 4 elements per rank, the others 5: without checks Gloo
  // would abort the processes.
  const int64_t n = g.rank() == 0 ? 4 : 5;
  at::Tensor out = at::empty({g.size() * n});
  std::string m = test::message_of<CollectiveError>(
      [&] { all_gather_into(g, out, at::ones({n})).wait(); });
  set_collective_checks(false);
  EXPECT_TRUE(contains(m, "collective mismatch on group 'world'")) << m;
  EXPECT_TRUE(contains(m, "group rank 0 (global 0): all_gather")) << m;
  EXPECT_TRUE(contains(m, "input numel 4")) << m;
  EXPECT_TRUE(contains(m, "input numel 5")) << m;
}

TEST(CollectiveErrors, CallsInDifferentOrderAreReportedWithChecks) {
  Group& g = *world_group();
  set_collective_checks(true);
  at::Tensor t = at::ones({3});
  std::string m = test::message_of<CollectiveError>([&] {
    if (g.rank() == 0) {
      broadcast(g, t, 0).wait();
    } else {
      all_reduce(g, t).wait();
    }
  });
  set_collective_checks(false);
  EXPECT_TRUE(contains(m, "broadcast")) << m;
  EXPECT_TRUE(contains(m, "all_reduce")) << m;
}

TEST(CollectiveErrors, TimeoutNamesOpRanksSizesAndSequence) {
  // A separate group with a short timeout: rank 0 issues an all-reduce that
  // nobody else joins.
  std::vector<int> all;
  for (int r = 0; r < get_world_size(); ++r) all.push_back(r);
  GroupPtr g = new_group(all, {"timeout-test", std::chrono::milliseconds(1500)});
  at::Tensor t = at::ones({2, 3});
  if (g->rank() == 0) {
    auto start = std::chrono::steady_clock::now();
    std::string m = test::message_of<CollectiveError>([&] { all_reduce(*g, t).wait(); });
    double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    EXPECT_TRUE(contains(m, "all_reduce failed on group 'world#timeout-test' ranks " +
                                to_string(all)))
        << m;
    EXPECT_TRUE(contains(m, "sequence number 0")) << m;
    EXPECT_TRUE(contains(m, "tensor [2, 3] Float")) << m;
    EXPECT_TRUE(contains(m, "timeout 1500 ms")) << m;
    EXPECT_TRUE(contains(m, "Timed out") || contains(m, "timed out")) << m;
    EXPECT_LT(waited, 30.0);
  }
  // Everyone meets again on the world group once rank 0 has seen its timeout.
  barrier(*world_group()).wait();
}

}  // namespace
}  // namespace hp::dist
