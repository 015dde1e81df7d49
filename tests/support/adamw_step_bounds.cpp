#include "tests/support/adamw_step_bounds.h"

#include <ATen/ATen.h>

#include <cmath>

#include "tests/support/rounding_bounds.h"

namespace hp::test {

// One AdamW step from the same (p, m, v, g) in float, by two evaluations
// that round differently, differs by at most (to first order in u = 2^-24,
// each rounding at most u times the magnitude it rounds):
//   m' = b1 m + (1 - b1) g, at most 3 roundings a side:   6 u (|m| + |g|)
//   v' = b2 v + (1 - b2) g², at most 4 a side:             8 u (v + g²)
//   den = sqrt(v') / sqrt(bc2) + eps, 3 a side, and v''s difference through
//     the square root:   |dv'| / (2 sqrt(v') sqrt(bc2)) + 6 u den
//   q = m' / den, 2 a side:   |dm'| / den + |m'| |dden| / den² + 4 u |q|
//   p' = p (1 - lr wd) - lr / bc1 q: the decay's 2 roundings and the final
//     subtraction's a side, and the scaling's 2 in all:
//     6 u |p| + lr / bc1 |dq| + 4 u |update|.
AdamWStepBounds adamw_step_bounds(const AdamWHyper& h, const at::Tensor& p0, const at::Tensor& m0,
                                  const at::Tensor& v0, const at::Tensor& g0, int64_t step) {
  const double u = unit_roundoff(at::kFloat);
  at::Tensor p = p0.to(at::kDouble), m = m0.to(at::kDouble), v = v0.to(at::kDouble),
             g = g0.to(at::kDouble);
  const double bc1 = 1 - std::pow(h.beta1, step), bc2 = 1 - std::pow(h.beta2, step);
  at::Tensor m1 = h.beta1 * m + (1 - h.beta1) * g;
  at::Tensor v1 = h.beta2 * v + (1 - h.beta2) * g * g;
  at::Tensor dm = 6 * u * (m.abs() + g.abs());
  at::Tensor dv = 8 * u * (v + g * g);
  at::Tensor den = v1.sqrt() / std::sqrt(bc2) + h.eps;
  at::Tensor dden = dv / (2 * v1.sqrt() * std::sqrt(bc2)) + 6 * u * den;
  at::Tensor q = m1 / den;
  at::Tensor dq = dm / den + m1.abs() * dden / (den * den) + 4 * u * q.abs();
  const double step_size = h.lr / bc1;
  at::Tensor dp = 6 * u * p.abs() + step_size * dq + 4 * u * step_size * q.abs();
  return {dm, dv, dp};
}

}  // namespace hp::test
