// Every collective of the facade on the world group, compared against what
// a single process computes from all ranks' inputs (each rank can recreate
// any rank's input: inputs are seeded by rank). Run on 2, 3 and 4 ranks,
// through the shared-memory channel, and on 3 ranks again through Gloo alone
// (HP_SHM=0).
//
// Inputs are small integers stored in the tested dtype, so sums are exact
// in every dtype and any reduction order; averages and one test's
// real-valued fp32 data are held to summation_bound of their terms
// (tests/support/rounding_bounds.h).
#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <string>
#include <thread>

#include "hp/distributed/collectives.h"
#include "hp/distributed/shm_channel.h"
#include "hp/distributed/world.h"
#include "hp/util/error.h"
#include "tests/support/rounding_bounds.h"
#include "tests/support/tensor_checks.h"

namespace hp::dist {
namespace {

using ::testing::HasSubstr;
using ::testing::ThrowsMessage;
using test::tensors_equal;
using test::within_bound;

// Rank r's input: integers in [-20, 20) as `dtype`, the same on every process.
at::Tensor input_of(int r, at::IntArrayRef shape, at::ScalarType dtype, int salt = 0) {
  at::Generator gen = at::detail::createCPUGenerator(1000 + 17 * r + salt);
  at::Tensor t = at::randint(-20, 20, shape, gen, at::kLong);
  if (dtype == at::kBool) return t > 0;
  return t.to(dtype);
}

// A collective's sum or average of `terms` (one per rank, in the tested
// dtype) against the exact value `expected`: within summation_bound of the
// terms (0 for integer dtypes; integer sums here are exact in every dtype,
// so for them only the average's scaling rounds). Max and min are exact.
testing::AssertionResult within_summation_bound(const at::Tensor& actual,
                                                const at::Tensor& expected,
                                                const std::vector<at::Tensor>& terms,
                                                ReduceOp op) {
  at::Tensor sum_abs = at::zeros(expected.sizes(), at::kDouble);
  if (op == ReduceOp::kMax || op == ReduceOp::kMin) return within_bound(actual, expected, sum_abs);
  for (const at::Tensor& t : terms) sum_abs += t.to(at::kDouble).abs();
  if (op == ReduceOp::kAvg) sum_abs /= static_cast<double>(terms.size());
  return within_bound(actual, expected,
                      test::summation_bound(sum_abs, static_cast<int64_t>(terms.size()),
                                            actual.scalar_type()));
}

// The exact result of reducing with `op` over the ranks: `stacked` holds
// one rank's input per row, in double.
at::Tensor reduce_over_ranks(const at::Tensor& stacked, ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return stacked.sum(0);
    case ReduceOp::kAvg: return stacked.mean(0);
    case ReduceOp::kMax: return stacked.amax(0);
    case ReduceOp::kMin: return stacked.amin(0);
  }
  return {};
}

class Collectives : public testing::TestWithParam<at::ScalarType> {
 protected:
  Group& world() { return *world_group(); }
  int rank() { return world_group()->rank(); }
  int size() { return world_group()->size(); }
};

INSTANTIATE_TEST_SUITE_P(Dtypes, Collectives,
                         testing::Values(at::kFloat, at::kDouble, at::kBFloat16, at::kHalf,
                                         at::kLong, at::kInt),
                         [](const testing::TestParamInfo<at::ScalarType>& info) {
                           return std::string(c10::toString(info.param));
                         });

TEST_P(Collectives, AllGatherIntoFlatBuffer) {
  const auto dtype = GetParam();
  at::Tensor in = input_of(rank(), {5, 3}, dtype);
  at::Tensor out = at::full({size() * 15}, 99, at::TensorOptions().dtype(dtype));
  const void* before = out.data_ptr();
  all_gather_into(world(), out, in).wait();
  EXPECT_EQ(out.data_ptr(), before) << "the output buffer must be filled in place";
  std::vector<at::Tensor> expected;
  for (int r = 0; r < size(); ++r) expected.push_back(input_of(r, {5, 3}, dtype).view(-1));
  EXPECT_TRUE(tensors_equal(out, at::cat(expected)));
}

TEST_P(Collectives, ReduceScatterSumAndAvg) {
  const auto dtype = GetParam();
  const int64_t n = 7;
  for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg}) {
    if (op == ReduceOp::kAvg && !at::isFloatingType(dtype)) continue;
    at::Tensor in = input_of(rank(), {size() * n}, dtype);
    at::Tensor out = at::empty({n}, in.options());
    reduce_scatter(world(), out, in, op).wait();
    at::Tensor total = at::zeros({size() * n}, at::kDouble);
    std::vector<at::Tensor> terms;
    for (int r = 0; r < size(); ++r) {
      terms.push_back(input_of(r, {size() * n}, dtype).narrow(0, rank() * n, n));
      total += input_of(r, {size() * n}, dtype).to(at::kDouble);
    }
    at::Tensor expected = total.narrow(0, rank() * n, n);
    if (op == ReduceOp::kAvg) expected = expected / size();
    EXPECT_TRUE(within_summation_bound(out, expected, terms, op)) << "op " << to_string(op);
    EXPECT_EQ(out.scalar_type(), dtype);
  }
}

TEST_P(Collectives, ReduceScatterMaxMin) {
  const auto dtype = GetParam();
  const int64_t n = 4;
  for (ReduceOp op : {ReduceOp::kMax, ReduceOp::kMin}) {
    at::Tensor in = input_of(rank(), {size() * n}, dtype);
    at::Tensor out = at::empty({n}, in.options());
    reduce_scatter(world(), out, in, op).wait();
    std::vector<at::Tensor> all;
    for (int r = 0; r < size(); ++r) all.push_back(input_of(r, {size() * n}, dtype));
    at::Tensor stacked = at::stack(all);
    at::Tensor expected = (op == ReduceOp::kMax ? stacked.amax(0) : stacked.amin(0))
                              .narrow(0, rank() * n, n);
    EXPECT_TRUE(tensors_equal(out, expected)) << "op " << to_string(op);
  }
}

TEST_P(Collectives, AllReduceEveryOp) {
  const auto dtype = GetParam();
  for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax, ReduceOp::kMin}) {
    if (op == ReduceOp::kAvg && !at::isFloatingType(dtype)) continue;
    at::Tensor t = input_of(rank(), {3, 4}, dtype, 5);
    all_reduce(world(), t, op).wait();
    std::vector<at::Tensor> all;
    for (int r = 0; r < size(); ++r) all.push_back(input_of(r, {3, 4}, dtype, 5).to(at::kDouble));
    at::Tensor stacked = at::stack(all);
    at::Tensor expected = reduce_over_ranks(stacked, op);
    std::vector<at::Tensor> terms;
    for (int r = 0; r < size(); ++r) terms.push_back(input_of(r, {3, 4}, dtype, 5));
    EXPECT_TRUE(within_summation_bound(t, expected, terms, op)) << "op " << to_string(op);
    EXPECT_EQ(t.scalar_type(), dtype);
  }
}

TEST_P(Collectives, BroadcastFromEachRank) {
  const auto dtype = GetParam();
  for (int source = 0; source < size(); ++source) {
    at::Tensor t = input_of(rank(), {6}, dtype, 9);
    broadcast(world(), t, source).wait();
    EXPECT_TRUE(tensors_equal(t, input_of(source, {6}, dtype, 9))) << "source " << source;
  }
}

TEST_P(Collectives, AllToAllEqualSplits) {
  const auto dtype = GetParam();
  // Rank r sends row block j to rank j.
  at::Tensor in = input_of(rank(), {size() * 2, 3}, dtype, 11);
  at::Tensor out = at::empty_like(in);
  all_to_all(world(), out, in).wait();
  std::vector<at::Tensor> expected;
  for (int r = 0; r < size(); ++r) {
    expected.push_back(input_of(r, {size() * 2, 3}, dtype, 11).narrow(0, rank() * 2, 2));
  }
  EXPECT_TRUE(tensors_equal(out, at::cat(expected)));
}

// Larger than one slot of the shared-memory channel (1 MiB per rank, in
// shm_channel.cpp) in every dtype, with a partial last chunk: the channel
// splits these into chunks; Gloo (HP_SHM=0) moves them whole.
constexpr int64_t kChunked = (int64_t{1} << 19) + 4099;

TEST_P(Collectives, AllGatherLargerThanAChunk) {
  const auto dtype = GetParam();
  at::Tensor in = input_of(rank(), {kChunked}, dtype, 31);
  at::Tensor out = at::empty({size() * kChunked}, in.options());
  all_gather_into(world(), out, in).wait();
  std::vector<at::Tensor> expected;
  for (int r = 0; r < size(); ++r) expected.push_back(input_of(r, {kChunked}, dtype, 31));
  EXPECT_TRUE(tensors_equal(out, at::cat(expected)));
}

TEST_P(Collectives, ReduceScatterLargerThanAChunk) {
  const auto dtype = GetParam();
  const int64_t n = kChunked / size();
  for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax, ReduceOp::kMin}) {
    if (op == ReduceOp::kAvg && !at::isFloatingType(dtype)) continue;
    at::Tensor in = input_of(rank(), {size() * n}, dtype, 33);
    at::Tensor out = at::empty({n}, in.options());
    reduce_scatter(world(), out, in, op).wait();
    std::vector<at::Tensor> all, terms;
    for (int r = 0; r < size(); ++r) {
      all.push_back(input_of(r, {size() * n}, dtype, 33).to(at::kDouble));
      terms.push_back(input_of(r, {size() * n}, dtype, 33).narrow(0, rank() * n, n));
    }
    at::Tensor stacked = at::stack(all).narrow(1, rank() * n, n);
    at::Tensor expected = reduce_over_ranks(stacked, op);
    EXPECT_TRUE(within_summation_bound(out, expected, terms, op)) << "op " << to_string(op);
  }
}

TEST_P(Collectives, AllReduceLargerThanAChunk) {
  const auto dtype = GetParam();
  for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax, ReduceOp::kMin}) {
    if (op == ReduceOp::kAvg && !at::isFloatingType(dtype)) continue;
    at::Tensor t = input_of(rank(), {kChunked}, dtype, 35);
    all_reduce(world(), t, op).wait();
    std::vector<at::Tensor> all, terms;
    for (int r = 0; r < size(); ++r) {
      all.push_back(input_of(r, {kChunked}, dtype, 35).to(at::kDouble));
      terms.push_back(input_of(r, {kChunked}, dtype, 35));
    }
    at::Tensor stacked = at::stack(all);
    at::Tensor expected = reduce_over_ranks(stacked, op);
    EXPECT_TRUE(within_summation_bound(t, expected, terms, op)) << "op " << to_string(op);
  }
}

// Replicas stay replicas: an all-reduce of real-valued data leaves the same
// bits on every rank (each element is reduced once and copied to all, by
// the channel and by Gloo's ring alike), checked by gathering the results.
TEST(CollectivesFloat, AllReduceLeavesTheSameBitsOnEveryRank) {
  Group& g = *world_group();
  at::Generator gen = at::detail::createCPUGenerator(91 + g.rank());
  at::Tensor t = at::randn({kChunked}, gen);
  all_reduce(g, t).wait();
  at::Tensor all = at::empty({g.size() * kChunked});
  all_gather_into(g, all, t).wait();
  for (int r = 0; r < g.size(); ++r) {
    EXPECT_TRUE(at::equal(all.narrow(0, r * kChunked, kChunked), t)) << "rank " << r << "'s result";
  }
}

// Every member of a group runs on this host: the bulk collectives go
// through shared memory unless HP_SHM=0 turned that off.
TEST(CollectivesTransport, GroupsOnOneHostShareMemoryUnlessTurnedOff) {
  const char* setting = std::getenv("HP_SHM");
  const bool off = setting && std::string(setting) == "0";
  EXPECT_EQ(world_group()->shm_channel() != nullptr, !off) << "HP_SHM=" << (setting ? setting : "");
}

TEST(CollectivesBool, GatherAndReduceBool) {
  Group& g = *world_group();
  at::Tensor in = input_of(g.rank(), {9}, at::kBool);
  at::Tensor out = at::empty({g.size() * 9}, at::kBool);
  all_gather_into(g, out, in).wait();
  std::vector<at::Tensor> expected;
  for (int r = 0; r < g.size(); ++r) expected.push_back(input_of(r, {9}, at::kBool));
  EXPECT_TRUE(tensors_equal(out, at::cat(expected)));

  at::Tensor any = input_of(g.rank(), {9}, at::kBool);
  all_reduce(g, any, ReduceOp::kMax).wait();
  EXPECT_TRUE(tensors_equal(any, at::stack(expected).any(0)));
}

TEST(CollectivesUneven, AllToAllUnevenSplits) {
  Group& g = *world_group();
  const int me = g.rank(), n = g.size();
  // Rank i sends (i + j + 1) rows to rank j.
  std::vector<int64_t> in_splits, out_splits;
  for (int j = 0; j < n; ++j) in_splits.push_back(me + j + 1);
  for (int i = 0; i < n; ++i) out_splits.push_back(i + me + 1);
  auto rows_of = [&](int i) {
    int64_t total = 0;
    for (int j = 0; j < n; ++j) total += i + j + 1;
    return at::arange(total * 2, at::kFloat).view({total, 2}) + 1000 * i;
  };
  at::Tensor in = rows_of(me);
  int64_t out_rows = 0;
  for (int64_t s : out_splits) out_rows += s;
  at::Tensor out = at::empty({out_rows, 2}, at::kFloat);
  all_to_all(g, out, in, out_splits, in_splits).wait();
  std::vector<at::Tensor> expected;
  for (int i = 0; i < n; ++i) {
    int64_t offset = 0;
    for (int j = 0; j < me; ++j) offset += i + j + 1;
    expected.push_back(rows_of(i).narrow(0, offset, i + me + 1));
  }
  EXPECT_TRUE(tensors_equal(out, at::cat(expected)));
}

TEST(CollectivesFloat, RealValuedReduceScatterWithinUlps) {
  Group& g = *world_group();
  const int64_t n = 1000;
  auto data = [&](int r) {
    at::Generator gen = at::detail::createCPUGenerator(77 + r);
    return at::randn({g.size() * n}, gen);
  };
  at::Tensor out = at::empty({n});
  reduce_scatter(g, out, data(g.rank())).wait();
  at::Tensor expected = at::zeros({g.size() * n}, at::kDouble);
  std::vector<at::Tensor> terms;
  for (int r = 0; r < g.size(); ++r) {
    expected += data(r).to(at::kDouble);
    terms.push_back(data(r).narrow(0, g.rank() * n, n));
  }
  EXPECT_TRUE(within_summation_bound(out, expected.narrow(0, g.rank() * n, n), terms,
                                     ReduceOp::kSum));
}

TEST(CollectivesAsync, HandlesOverlapAndCompleteInAnyOrder) {
  Group& g = *world_group();
  at::Tensor a = at::full({1000}, float(g.rank() + 1));
  at::Tensor b = at::empty({g.size() * 3});
  at::Tensor b_in = at::full({3}, float(g.rank()));
  Work wa = all_reduce(g, a);
  Work wb = all_gather_into(g, b, b_in);
  // Waiting on the later one first must not deadlock; wait() is idempotent.
  wb.wait();
  wa.wait();
  wa.wait();
  float total = g.size() * (g.size() + 1) / 2.0f;
  EXPECT_TRUE(tensors_equal(a, at::full({1000}, total)));
  std::vector<at::Tensor> expected;
  for (int r = 0; r < g.size(); ++r) expected.push_back(at::full({3}, float(r)));
  EXPECT_TRUE(tensors_equal(b, at::cat(expected)));
}

TEST(CollectivesAsync, CompletionIsReportedWithoutWaiting) {
  // is_completed() turns true once the backend has finished, whether or not
  // anyone waits: a caller may poll instead of blocking.
  Group& g = *world_group();
  at::Tensor t = at::ones({16});
  Work w = all_reduce(g, t);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (!w.is_completed() && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  EXPECT_TRUE(w.is_completed()) << "not completed 30 s after issue, without wait()";
  w.wait();
  EXPECT_TRUE(tensors_equal(t, at::full({16}, float(g.size()))));
  EXPECT_TRUE(Work().is_completed()) << "a trivial handle is complete";
}

// fp16, like bf16, is reduced in fp32 (collectives.h): the fp16 result is
// the fp32 result rounded once. The inputs are multiples of 2^-8 below 8 in
// magnitude: exact in fp16, and their sums are exact in fp32, whereas
// summing in fp16 would round partial sums (visible from 3 ranks on).
TEST(CollectivesHalf, AllReduceMatchesTheFp32Result) {
  Group& g = *world_group();
  auto data = [](int r) {
    at::Generator gen = at::detail::createCPUGenerator(4242 + r);
    return at::randint(-2047, 2048, {4096}, gen, at::kLong).to(at::kFloat) / 256;
  };
  for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg}) {
    at::Tensor half = data(g.rank()).to(at::kHalf);
    at::Tensor full = data(g.rank());
    all_reduce(g, half, op).wait();
    all_reduce(g, full, op).wait();
    EXPECT_EQ(half.scalar_type(), at::kHalf);
    EXPECT_TRUE(tensors_equal(half, full.to(at::kHalf))) << "op " << to_string(op);
  }
}

TEST(CollectivesEmpty, ZeroElementCollectivesComplete) {
  Group& g = *world_group();
  const uint64_t before = g.sequence_number();
  at::Tensor in = at::empty({0});
  at::Tensor out = at::empty({0});
  std::vector<Work> works;
  works.push_back(all_gather_into(g, out, in));
  works.push_back(reduce_scatter(g, out, in));
  works.push_back(all_reduce(g, out));
  works.push_back(barrier(g));
  for (size_t i = 0; i < works.size(); ++i) {
    works[i].wait();
    EXPECT_TRUE(works[i].is_completed()) << "collective " << i;
  }
  EXPECT_EQ(out.sizes(), at::IntArrayRef({0}));
  EXPECT_EQ(in.sizes(), at::IntArrayRef({0}));
  // Each counted as one call of the group, on every rank alike: a real
  // collective right after them still pairs up across ranks.
  EXPECT_EQ(g.sequence_number(), before + 4);
  at::Tensor t = at::full({3}, float(g.rank() + 1));
  all_reduce(g, t).wait();
  EXPECT_TRUE(tensors_equal(t, at::full({3}, float(g.size() * (g.size() + 1) / 2))));
}

TEST(CollectivesSequence, EveryCollectiveAdvancesTheSequenceNumber) {
  Group& g = *world_group();
  uint64_t before = g.sequence_number();
  at::Tensor t = at::ones({2});
  all_reduce(g, t).wait();
  barrier(g).wait();
  broadcast(g, t, 0).wait();
  EXPECT_EQ(g.sequence_number(), before + 3);
}

}  // namespace
}  // namespace hp::dist

namespace hp::dist {
namespace {

TEST(CollectivesCoalesced, GathersSeveralTensorsIntoStridedViews) {
  Group& g = *world_group();
  const int n = g.size();
  // Two inputs per rank; outputs are column blocks of [n*2, 3] and rows of
  // another buffer: strided and contiguous views.
  at::Tensor a = input_of(g.rank(), {2, 3}, at::kFloat, 21);
  at::Tensor b = input_of(g.rank(), {5}, at::kFloat, 22);
  at::Tensor wide = at::zeros({2, 3 * n});
  at::Tensor rows = at::zeros({n, 5});
  std::vector<std::vector<at::Tensor>> outputs(n);
  for (int r = 0; r < n; ++r) outputs[r] = {wide.narrow(1, 3 * r, 3), rows[r]};
  Work w = all_gather_coalesced(g, outputs, {a, b});
  w.wait();
  for (int r = 0; r < n; ++r) {
    EXPECT_TRUE(tensors_equal(wide.narrow(1, 3 * r, 3), input_of(r, {2, 3}, at::kFloat, 21)));
    EXPECT_TRUE(tensors_equal(rows[r], input_of(r, {5}, at::kFloat, 22)));
  }
  EXPECT_THAT([&] { all_gather_coalesced(g, outputs, {a, b.to(at::kDouble)}); },
              ThrowsMessage<ArgumentError>(HasSubstr("input 1 is Double but input 0 is Float")));
}

// fully_shard's fused gather: contiguous outputs (each rank's piece of each
// parameter), here with inputs that straddle chunk boundaries of the
// shared-memory channel (one smaller than a chunk between two larger).
TEST(CollectivesCoalesced, GathersSeveralContiguousTensorsAcrossChunks) {
  Group& g = *world_group();
  const int n = g.size();
  const std::vector<std::vector<int64_t>> shapes = {{kChunked / 2, 3}, {5}, {kChunked + 7}};
  std::vector<at::Tensor> inputs, gathered;
  std::vector<std::vector<at::Tensor>> outputs(n);
  for (size_t i = 0; i < shapes.size(); ++i) {
    inputs.push_back(input_of(g.rank(), shapes[i], at::kDouble, 40 + static_cast<int>(i)));
    std::vector<int64_t> stacked = shapes[i];
    stacked.insert(stacked.begin(), n);
    gathered.push_back(at::zeros(stacked, at::kDouble));
    for (int r = 0; r < n; ++r) outputs[r].push_back(gathered[i][r]);
  }
  all_gather_coalesced(g, outputs, inputs).wait();
  for (size_t i = 0; i < shapes.size(); ++i) {
    for (int r = 0; r < n; ++r) {
      EXPECT_TRUE(tensors_equal(gathered[i][r],
                                input_of(r, shapes[i], at::kDouble, 40 + static_cast<int>(i))))
          << "input " << i << " of rank " << r;
    }
  }
}

}  // namespace
}  // namespace hp::dist
