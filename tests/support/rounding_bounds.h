// How far two floating-point computations of the same value can differ when
// they perform the same operations in another order, and an assertion that
// holds a result to such a bound. Parity tests derive every tolerance here
// from the tensors they compare instead of a fixed atol.
#pragma once

#include <gtest/gtest.h>

#include <ATen/core/Tensor.h>

#include <map>
#include <string>

namespace hp::test {

// Unit roundoff u of a floating dtype: 2^-24 for Float, 2^-53 for Double,
// 2^-8 for BFloat16, 2^-11 for Half.
double unit_roundoff(at::ScalarType dtype);

// A floating-point sum of n terms, in any order, with each term or the
// result scaled once (the 1/n of a mean, applied before or after), is within
// 2 n u Σ|terms| of the exact value elementwise: each of the n - 1
// additions rounds a partial sum no larger than Σ|terms| by at most u times
// it, whatever the order (to first order in u), and the scalings add at
// most n such roundings. `sum_abs_terms` is Σ|terms|
// elementwise (after the scaling), in any dtype; the bound is returned in
// Double. Integer dtypes sum exactly: the bound is 0.
at::Tensor summation_bound(const at::Tensor& sum_abs_terms, int64_t n, at::ScalarType dtype);

// Two such sums of the same n terms (say a collective's and a single
// process's): each is within summation_bound of the exact value, so they
// differ by at most twice that, 4 n u Σ|terms|.
at::Tensor reordered_sum_bound(const at::Tensor& sum_abs_terms, int64_t n, at::ScalarType dtype);

// Scalar form of reordered_sum_bound.
double reordered_sum_bound(double sum_abs_terms, int64_t n, at::ScalarType dtype);

// |actual - expected| <= bound elementwise (bound broadcast to the shape),
// compared in Double. On failure the message names the largest excess; on
// success the largest |actual - expected| / bound is recorded for
// worst_bound_use().
testing::AssertionResult within_bound(const at::Tensor& actual, const at::Tensor& expected,
                                      const at::Tensor& bound);
testing::AssertionResult within_bound(double actual, double expected, double bound);

// The largest observed |actual - expected| / bound over every within_bound
// of this process so far (0 when nothing differed): how much of its bound
// the closest call used. With HP_TEST_PRINT_BOUND_USE set the test main
// prints it after each test and resets it.
double worst_bound_use();
void reset_worst_bound_use();

// AdamW's hyperparameters, as torch::optim::AdamWOptions has them.
struct AdamWHyper {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 1e-2;
};

// How far one AdamW step can move a parameter differently in two runs that
// start the step from the same parameter value and feed it gradients that
// differ by at most a known bound at every step so far.
//
// The two runs' moment estimates stay inside intervals: m and v are
// monotone in g (v in |g|), so every step widens [m_lo, m_hi] and
// [v_lo, v_hi] by what the gradient interval [g - δ, g + δ] allows, and the
// update m̂ / (sqrt(v̂) + eps) is bounded by its extremes over that box. This
// is what Adam amplifies: where v ≈ 0 (|g| ~ eps) a gradient difference of
// a few ulps can turn into an update difference of up to ~2 lr, and the
// bound says so for exactly those elements. Rounding of the step itself in
// either run adds a few ulps of |param| + |update|.
class AdamWBound {
 public:
  explicit AdamWBound(AdamWHyper hyper) : hyper_(hyper) {}

  // The step of parameter `name` (value before the step `param`, gradient
  // `grad` of one run, the other within `grad_bound` of it). Returns the
  // elementwise bound on the difference of the two runs' parameters after
  // the step, in Double. Call once per parameter per optimizer step, steps
  // in order.
  at::Tensor step(const std::string& name, const at::Tensor& param, const at::Tensor& grad,
                  const at::Tensor& grad_bound);

 private:
  struct Moments {
    at::Tensor m_lo, m_hi, v_lo, v_hi;
    int64_t steps = 0;
  };
  AdamWHyper hyper_;
  std::map<std::string, Moments> moments_;
};

}  // namespace hp::test
