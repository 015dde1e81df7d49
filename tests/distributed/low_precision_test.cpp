// bf16 and fp16 reductions, and the rounding each is held to.
//
// Two ways to reduce a low-precision dtype:
//  - the facade on Gloo and the shared-memory channel sums in fp32 and rounds
//    once (collectives.h);
//  - a backend that reduces the dtype natively (NCCL on a GPU) rounds every
//    partial sum to the dtype, and averages fp16 by dividing before and
//    after the sum (native_average.h).
// Gloo of libtorch 2.x sums bf16 and fp16 natively too (1.13's refuses
// bf16: those cases skip), so the native arithmetic and its bound run here
// on the CPU, through c10d's own all-reduce on the world group.
//
// The bounds, with u the dtype's unit roundoff (2^-8 for bf16, 2^-11 for
// fp16) and s = Σ x_r the exact sum of the N ranks' values (each already in
// the dtype, so the inputs carry no rounding):
//  - fp32 then one rounding: the fp32 sum is within e = 2 N u32 Σ|x_r| of s
//    (summation_bound), and rounding it to the dtype moves it by at most
//    u (|s| + e): bound e (1 + u) + u |s|.
//  - native: N - 1 additions in any order, each rounding a partial sum no
//    larger than Σ|x_r| by at most u times it: within (N - 1) u Σ|x_r|, so
//    within summation_bound(Σ|x_r|, N, dtype) = 2 N u Σ|x_r|.
//  - native fp16 average with pre and post: x / pre is exact (a power of
//    two, normal values), the sum's N - 1 roundings are each at most
//    u Σ|x_r| / pre, divided by post they are u Σ|x_r| / N each, and the
//    division by post rounds once more (u |mean|): within
//    summation_bound(Σ|x_r| / N, N, fp16).
// The data keeps every value and partial sum a normal number (magnitudes
// 2^-4 to 2^6, or the chosen large fp16 values), where the relative error
// model holds.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <cmath>
#include <string>
#include <vector>

#include "hp/distributed/collectives.h"
#include "hp/distributed/native_average.h"
#include "hp/distributed/world.h"
#include "tests/support/rounding_bounds.h"

namespace hp::dist {
namespace {

using test::summation_bound;
using test::unit_roundoff;
using test::within_bound;

constexpr int64_t kNumel = 4096;

// Rank r's values in `dtype`: sign * (1 + U[0, 1)) * 2^k, k in [-4, 5], so
// every value is a normal number of either dtype and sums mix magnitudes
// (the roundings this file bounds happen).
at::Tensor values_of(int r, at::ScalarType dtype) {
  at::Generator gen = at::detail::createCPUGenerator(9100 + r);
  at::Tensor mantissa = 1 + at::rand({kNumel}, gen, at::kDouble);
  at::Tensor exponent = at::randint(-4, 6, {kNumel}, gen, at::kLong).to(at::kDouble);
  at::Tensor sign = at::randint(0, 2, {kNumel}, gen, at::kLong).to(at::kDouble) * 2 - 1;
  return (sign * mantissa * at::pow(2.0, exponent)).to(dtype);
}

// c10d's own all-reduce (sum) of `t` in its dtype; false when the backend
// has no native reduction for it (Gloo of libtorch 1.13 and bf16).
bool native_sum(Group& group, at::Tensor& t) {
  std::vector<at::Tensor> tensors{t};
  try {
    group.process_group().allreduce(tensors)->wait();
  } catch (const c10::Error& e) {
    if (std::string(e.what()).find("Invalid scalar type") != std::string::npos) return false;
    throw;
  }
  return true;
}

class LowPrecisionSum : public testing::TestWithParam<at::ScalarType> {};

INSTANTIATE_TEST_SUITE_P(Dtypes, LowPrecisionSum, testing::Values(at::kBFloat16, at::kHalf),
                         [](const testing::TestParamInfo<at::ScalarType>& info) {
                           return std::string(c10::toString(info.param));
                         });

TEST_P(LowPrecisionSum, TheFacadeRoundsOnceAfterAnFp32Sum) {
  const at::ScalarType dtype = GetParam();
  Group& g = *world_group();
  at::Tensor t = values_of(g.rank(), dtype);
  all_reduce(g, t).wait();
  at::Tensor exact = at::zeros({kNumel}, at::kDouble), abs_sum = exact.clone();
  for (int r = 0; r < g.size(); ++r) {
    exact += values_of(r, dtype).to(at::kDouble);
    abs_sum += values_of(r, dtype).to(at::kDouble).abs();
  }
  const double u = unit_roundoff(dtype);
  at::Tensor fp32_error = summation_bound(abs_sum, g.size(), at::kFloat);
  EXPECT_EQ(t.scalar_type(), dtype);
  EXPECT_TRUE(within_bound(t, exact, fp32_error * (1 + u) + u * exact.abs()));
}

TEST_P(LowPrecisionSum, ANativeSumIsWithinItsDerivedBound) {
  const at::ScalarType dtype = GetParam();
  Group& g = *world_group();
  at::Tensor t = values_of(g.rank(), dtype);
  if (!native_sum(g, t)) GTEST_SKIP() << "this Gloo has no native " << dtype << " sum";
  at::Tensor exact = at::zeros({kNumel}, at::kDouble), abs_sum = exact.clone();
  for (int r = 0; r < g.size(); ++r) {
    exact += values_of(r, dtype).to(at::kDouble);
    abs_sum += values_of(r, dtype).to(at::kDouble).abs();
  }
  EXPECT_EQ(t.scalar_type(), dtype);
  EXPECT_TRUE(within_bound(t, exact, summation_bound(abs_sum, g.size(), dtype)));
}

TEST(NativeAverage, Fp16DividesBeforeAndAfterTheSumOtherDtypesUseTheBackendsAverage) {
  for (int n = 1; n <= 64; ++n) {
    SCOPED_TRACE("group size " + std::to_string(n));
    for (at::ScalarType other : {at::kFloat, at::kBFloat16, at::kDouble}) {
      EXPECT_TRUE(native_average(other, n).backend_average);
    }
    const NativeAverage a = native_average(at::kHalf, n);
    EXPECT_FALSE(a.backend_average);
    EXPECT_EQ(a.pre * a.post, n);
    EXPECT_EQ(a.pre & (a.pre - 1), 0) << "pre " << a.pre << " is a power of two";
    EXPECT_LE(a.pre * a.pre, n);
    // The largest such power of two.
    EXPECT_FALSE(n % (2 * a.pre) == 0 && 4 * a.pre * a.pre <= n) << "pre " << a.pre;
  }
  EXPECT_EQ(native_average(at::kHalf, 4).pre, 2);
  EXPECT_EQ(native_average(at::kHalf, 16).pre, 4);
  EXPECT_EQ(native_average(at::kHalf, 12).post, 6);
}

// Values whose fp16 sum overflows while their average does not: the plain
// native sum is inf, the pre/post average is finite and within its bound.
TEST(NativeAverage, Fp16AverageStaysInRangeWhereTheSumOverflows) {
  Group& g = *world_group();
  const NativeAverage average = native_average(at::kHalf, g.size());
  if (average.pre == 1) {
    GTEST_SKIP() << g.size() << " ranks: no power of two above 1 divides the group size within "
                 << "its square root, so fp16 averages as a plain sum divided after";
  }
  // Each value in [0.6, 0.9] x 65504 / post: N of them sum past fp16's
  // largest finite value (N x 0.6 / post >= 1.2 as N >= 2 post), while the
  // pre-divided sum stays below 0.9 x 65504.
  const double top = 65504.0 / average.post;
  auto value_of = [&](int r) {
    at::Generator gen = at::detail::createCPUGenerator(9300 + r);
    return (top * (0.6 + 0.3 * at::rand({kNumel}, gen, at::kDouble))).to(at::kHalf);
  };
  at::Tensor plain = value_of(g.rank());
  if (!native_sum(g, plain)) GTEST_SKIP() << "this Gloo has no native fp16 sum";
  EXPECT_TRUE(plain.to(at::kDouble).isinf().all().item<bool>())
      << "the values must overflow a plain fp16 sum for this test to show anything";

  at::Tensor t = value_of(g.rank()) / average.pre;
  ASSERT_TRUE(native_sum(g, t));
  t.div_(average.post);
  at::Tensor mean = at::zeros({kNumel}, at::kDouble), abs_sum = mean.clone();
  for (int r = 0; r < g.size(); ++r) {
    mean += value_of(r).to(at::kDouble) / g.size();
    abs_sum += value_of(r).to(at::kDouble).abs() / g.size();
  }
  EXPECT_TRUE(at::isfinite(t).all().item<bool>());
  EXPECT_TRUE(within_bound(t, mean, summation_bound(abs_sum, g.size(), at::kHalf)));
}

}  // namespace
}  // namespace hp::dist
