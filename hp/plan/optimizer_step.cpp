// After backward: hp::clip_grad_norm_'s fp64 copies and AdamW's moments
// and temporaries.
#include "hp/plan/step_simulator.h"

#include <algorithm>

#include "hp/optim/fused_adamw.h"

namespace hp::plan::detail {

void StepSimulator::clip() {
  if (!s_.options.grad_clip) return;
  t_.at("clip_grad_norm_");
  // Each gradient's norm is taken in fp64: a double copy of it (a
  // DTensor gradient's local piece).
  int64_t largest = 0;
  for (const Unit& u : units_) {
    for (const auto& p : u.params) largest = std::max(largest, local_numel(p));
  }
  t_.spike(Term::kSlack, largest * kFp64);
}

void StepSimulator::optimizer_step() {
  t_.at("optimizer step");
  // hp-train's AdamW (hp/optim/fused_adamw.h), per parameter in
  // model->parameters() order: the moments are created on the first step.
  // libtorch's fused kernel then updates in place; where this libtorch has
  // none, AdamW's own step makes sqrt(exp_avg_sq) and its scaled copy, the
  // step's temporaries.
  const bool fused = optim::FusedAdamW::available();
  for (const auto& [unit, index] : optimizer_order_) {
    const int64_t bytes = local_numel(units_[unit].params[index]) * s_.model_dtype_size;
    if (first_) adam_.push_back(t_.alloc(Term::kOptimizer, 2 * bytes));
    if (!fused) t_.spike(Term::kOptimizer, 2 * bytes);
  }
}

}  // namespace hp::plan::detail
