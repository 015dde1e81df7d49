// Errors of the collectives facade (D3, D5): local argument errors are
// raised before anything reaches the wire; cross-rank mismatches (with
// checks on) and timeouts become CollectiveErrors that name the op, the
// group's ranks, the sizes and the sequence number.
#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <thread>

#include "hp/distributed/collective_checks.h"
#include "hp/distributed/collectives.h"
#include "hp/distributed/shm_channel.h"
#include "hp/distributed/world.h"
#include "hp/util/error.h"

namespace hp::dist {
namespace {

using ::testing::AllOf;
using ::testing::AnyOf;
using ::testing::HasSubstr;
using ::testing::ThrowsMessage;

TEST(CollectiveErrors, LocalArgumentErrorsNameTheProblem) {
  Group& g = *world_group();
  const int n = g.size();

  EXPECT_THAT([&] { all_gather_into(g, at::empty({n * 3 + 1}), at::ones({3})); },
              ThrowsMessage<ArgumentError>(
                  AllOf(HasSubstr("all_gather: output [" + std::to_string(n * 3 + 1) + "]"),
                        HasSubstr("must have group size " + std::to_string(n)))));

  EXPECT_THAT([&] { all_gather_into(g, at::empty({n * 2, 2}).t(), at::ones({2})); },
              ThrowsMessage<ArgumentError>(
                  AllOf(HasSubstr("output"), HasSubstr("must be contiguous"))));

  EXPECT_THAT([&] { all_gather_into(g, at::empty({n}, at::kDouble), at::ones({1})); },
              ThrowsMessage<ArgumentError>(
                  HasSubstr("output dtype Double differs from input dtype Float")));

  EXPECT_THAT([&] { reduce_scatter(g, at::empty({2}), at::ones({n * 2 + 1})); },
              ThrowsMessage<ArgumentError>(
                  HasSubstr("reduce_scatter: input [" + std::to_string(n * 2 + 1) + "]")));

  EXPECT_THAT([&] { all_reduce(g, at::ones({2}, at::kLong), ReduceOp::kAvg); },
              ThrowsMessage<ArgumentError>(
                  HasSubstr("reduce op 'avg' needs a floating-point tensor, got Long")));

  EXPECT_THAT([&] { broadcast(g, at::ones({2}), n); },
              ThrowsMessage<ArgumentError>(
                  HasSubstr("broadcast: source " + std::to_string(n) + " is not a group rank")));

  EXPECT_THAT(
      [&] {
        std::vector<int64_t> splits(n, 1);
        splits[0] = 5;
        all_to_all(g, at::empty({n}), at::ones({n}), {}, splits);
      },
      ThrowsMessage<ArgumentError>(AllOf(HasSubstr("input_splits"), HasSubstr("sum to"))));

  EXPECT_THAT([&] { all_to_all(g, at::empty({2 * n, 3}), at::ones({n, 3})); },
              ThrowsMessage<ArgumentError>(HasSubstr(
                  "all_to_all: with equal splits output [" + std::to_string(2 * n) +
                  ", 3] Float (" + std::to_string(6 * n) + " elements) and input [" +
                  std::to_string(n) + ", 3] Float (" + std::to_string(3 * n) +
                  " elements) must have the same number of elements")));

  EXPECT_THAT([&] { all_reduce(g, at::Tensor()); },
              ThrowsMessage<ArgumentError>(HasSubstr("tensor is an undefined tensor")));

  EXPECT_THAT([] { parse_reduce_op("prod"); },
              ThrowsMessage<ArgumentError>(HasSubstr(
                  "reduce_op must be one of ['sum', 'avg', 'max', 'min'] but got 'prod'")));
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
  EXPECT_THAT([&] { all_gather_into(g, out, at::ones({n})).wait(); },
              ThrowsMessage<CollectiveError>(
                  AllOf(HasSubstr("collective mismatch on group 'world'"),
                        HasSubstr("group rank 0 (global 0): all_gather"),
                        HasSubstr("input numel 4"), HasSubstr("input numel 5"))));
  set_collective_checks(false);
}

TEST(CollectiveErrors, CallsInDifferentOrderAreReportedWithChecks) {
  Group& g = *world_group();
  set_collective_checks(true);
  at::Tensor t = at::ones({3});
  EXPECT_THAT(
      [&] {
        if (g.rank() == 0) {
          broadcast(g, t, 0).wait();
        } else {
          all_reduce(g, t).wait();
        }
      },
      ThrowsMessage<CollectiveError>(AllOf(HasSubstr("broadcast"), HasSubstr("all_reduce"))));
  set_collective_checks(false);
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
    EXPECT_THAT([&] { all_reduce(*g, t).wait(); },
                ThrowsMessage<CollectiveError>(AllOf(
                    HasSubstr("all_reduce failed on group 'world#timeout-test' ranks " +
                              to_string(all)),
                    HasSubstr("sequence number 0"), HasSubstr("tensor [2, 3] Float"),
                    HasSubstr("timeout 1500 ms"),
                    AnyOf(HasSubstr("Timed out"), HasSubstr("timed out")))));
    double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    EXPECT_LT(waited, 30.0);
  }
  // Everyone meets again on the world group once rank 0 has seen its timeout.
  barrier(*world_group()).wait();
}

// A collective that failed in the shared-memory channel leaves the ranks
// at different points of it: the group refuses every later collective, on
// every rank, instead of pairing one rank's chunk with another's stale one.
TEST(CollectiveErrors, AFailedSharedMemoryChannelRefusesLaterCollectivesEverywhere) {
  std::vector<int> all;
  for (int r = 0; r < get_world_size(); ++r) all.push_back(r);
  GroupPtr g = new_group(all, {"shm-failure-test", std::chrono::milliseconds(1500)});
  if (g->shm_channel() == nullptr) GTEST_SKIP() << "no shared-memory channel (HP_SHM=0)";
  at::Tensor t = at::ones({2, 3});
  if (g->rank() == 0) {
    EXPECT_THAT([&] { all_gather_into(*g, at::empty({g->size() * 6}), t).wait(); },
                ThrowsMessage<CollectiveError>(HasSubstr("timed out")));
  }
  barrier(*world_group()).wait();
  // Everyone now issues the same collective; on no rank may it run.
  auto expected = g->rank() == 0
                      ? HasSubstr("is unusable since an earlier collective failed (timed out")
                      : HasSubstr("group rank 0 failed in the shared-memory channel");
  EXPECT_THAT([&] { all_gather_into(*g, at::empty({g->size() * 6}), t).wait(); },
              ThrowsMessage<CollectiveError>(AllOf(HasSubstr("all_gather failed on group "
                                                             "'world#shm-failure-test'"),
                                                   expected)));
  barrier(*world_group()).wait();
}

}  // namespace
}  // namespace hp::dist
