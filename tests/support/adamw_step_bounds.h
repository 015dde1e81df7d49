// The elementwise bound on one AdamW step evaluated twice in fp32 with
// different roundings (libtorch's AdamW and the fused kernel), from the same
// (p, m, v, g): how it is derived is in adamw_step_bounds.cpp.
#pragma once

#include <cstdint>

#include <ATen/core/Tensor.h>

#include "tests/support/rounding_bounds.h"

namespace hp::test {

// Bounds (fp64 tensors) on |m' - m''|, |v' - v''| and |p' - p''|.
struct AdamWStepBounds {
  at::Tensor m, v, p;
};

// `h`: the step's lr, betas and eps (its weight decay enters through p).
AdamWStepBounds adamw_step_bounds(const AdamWHyper& h, const at::Tensor& p0, const at::Tensor& m0,
                                  const at::Tensor& v0, const at::Tensor& g0, int64_t step);

}  // namespace hp::test
