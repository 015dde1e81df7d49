#include "tests/support/rounding_bounds.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <limits>

namespace hp::test {
namespace {

double worst_use = 0;

// Records |diff| / bound where the bound is positive (a zero bound demands
// equality, which the excess check already enforces).
void record_use(const at::Tensor& diff, const at::Tensor& bound) {
  if (diff.numel() == 0) return;
  at::Tensor use = at::where(bound > 0, diff / bound, at::zeros_like(diff));
  worst_use = std::max(worst_use, use.max().item<double>());
}

}  // namespace

double unit_roundoff(at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat: return std::ldexp(1.0, -24);
    case at::kDouble: return std::ldexp(1.0, -53);
    case at::kBFloat16: return std::ldexp(1.0, -8);
    case at::kHalf: return std::ldexp(1.0, -11);
    default: return 0;  // integers: sums are exact
  }
}

at::Tensor summation_bound(const at::Tensor& sum_abs_terms, int64_t n, at::ScalarType dtype) {
  return sum_abs_terms.to(at::kDouble) * (2.0 * static_cast<double>(n) * unit_roundoff(dtype));
}

at::Tensor reordered_sum_bound(const at::Tensor& sum_abs_terms, int64_t n, at::ScalarType dtype) {
  return 2 * summation_bound(sum_abs_terms, n, dtype);
}

double reordered_sum_bound(double sum_abs_terms, int64_t n, at::ScalarType dtype) {
  return 4.0 * static_cast<double>(n) * unit_roundoff(dtype) * sum_abs_terms;
}

testing::AssertionResult within_bound(const at::Tensor& actual, const at::Tensor& expected,
                                      const at::Tensor& bound) {
  if (actual.sizes() != expected.sizes()) {
    return testing::AssertionFailure() << "shape " << actual.sizes() << " != expected "
                                       << expected.sizes();
  }
  at::Tensor diff = (actual.to(at::kDouble) - expected.to(at::kDouble)).abs();
  at::Tensor b = bound.to(at::kDouble).expand_as(diff);
  at::Tensor excess = diff - b;
  if (diff.numel() > 0 && excess.max().item<double>() > 0) {
    const int64_t at_index = excess.view(-1).argmax().item<int64_t>();
    return testing::AssertionFailure()
           << "|actual - expected| exceeds its bound by up to "
           << excess.max().item<double>() << ": at flat index " << at_index << " actual "
           << actual.to(at::kDouble).reshape(-1)[at_index].item<double>() << " expected "
           << expected.to(at::kDouble).reshape(-1)[at_index].item<double>() << " bound "
           << b.reshape(-1)[at_index].item<double>() << " (" << (excess > 0).sum().item<int64_t>()
           << " of " << diff.numel() << " elements over)";
  }
  record_use(diff, b);
  return testing::AssertionSuccess();
}

testing::AssertionResult within_bound(double actual, double expected, double bound) {
  return within_bound(at::scalar_tensor(actual, at::kDouble),
                      at::scalar_tensor(expected, at::kDouble),
                      at::scalar_tensor(bound, at::kDouble));
}

double worst_bound_use() { return worst_use; }
void reset_worst_bound_use() { worst_use = 0; }

at::Tensor AdamWBound::step(const std::string& name, const at::Tensor& param,
                            const at::Tensor& grad, const at::Tensor& grad_bound) {
  const double b1 = hyper_.beta1, b2 = hyper_.beta2;
  const double u = unit_roundoff(param.scalar_type());
  at::Tensor g = grad.to(at::kDouble), d = grad_bound.to(at::kDouble).expand_as(g);
  at::Tensor g_lo = g - d, g_hi = g + d;
  // g² over [g_lo, g_hi]: 0 when the interval holds 0, else the nearer end's square.
  at::Tensor sq_lo = at::where(g_lo > 0, g_lo * g_lo,
                               at::where(g_hi < 0, g_hi * g_hi, at::zeros_like(g)));
  at::Tensor sq_hi = at::maximum(g_lo * g_lo, g_hi * g_hi);
  auto it = moments_.find(name);
  if (it == moments_.end()) {
    at::Tensor zero = at::zeros_like(g);
    it = moments_.emplace(name, Moments{zero, zero, zero, zero, 0}).first;
  }
  Moments& s = it->second;
  s.m_lo = b1 * s.m_lo + (1 - b1) * g_lo;
  s.m_hi = b1 * s.m_hi + (1 - b1) * g_hi;
  s.v_lo = b2 * s.v_lo + (1 - b2) * sq_lo;
  s.v_hi = b2 * s.v_hi + (1 - b2) * sq_hi;
  ++s.steps;
  const double bc1 = 1 - std::pow(b1, s.steps), bc2 = 1 - std::pow(b2, s.steps);
  // The update is lr / bc1 * m / (sqrt(v / bc2) + eps) with a positive
  // denominator: its extremes over the box lie at the box's corners.
  at::Tensor den_lo = s.v_lo.sqrt() / std::sqrt(bc2) + hyper_.eps;
  at::Tensor den_hi = s.v_hi.sqrt() / std::sqrt(bc2) + hyper_.eps;
  at::Tensor r_lo = at::where(s.m_lo >= 0, s.m_lo / den_hi, s.m_lo / den_lo);
  at::Tensor r_hi = at::where(s.m_hi >= 0, s.m_hi / den_lo, s.m_hi / den_hi);
  const double step_size = hyper_.lr / bc1;
  at::Tensor width = step_size * (r_hi - r_lo);
  // Each run rounds its own m, v (a few ulps per step, compounding over the
  // steps), the update's sqrt, division and scaling, the decay and the final
  // add: 2 u |param| + 8 (steps + 2) u |update| covers them with room.
  at::Tensor largest_update = step_size * at::maximum(r_lo.abs(), r_hi.abs());
  at::Tensor rounding = 2 * u * param.to(at::kDouble).abs() +
                        8.0 * static_cast<double>(s.steps + 2) * u * largest_update;
  return width + rounding;
}

}  // namespace hp::test
