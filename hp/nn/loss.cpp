#include "hp/nn/loss.h"

#include <torch/torch.h>

#include "hp/util/error.h"

namespace hp::nn {

at::Tensor cross_entropy(const at::Tensor& logits, const at::Tensor& targets) {
  HP_CHECK_ARG(logits.dim() == 3 && at::isFloatingType(logits.scalar_type()),
               "cross_entropy: logits must be a floating [B, T, V] tensor but got ",
               logits.scalar_type(), " of shape ", logits.sizes());
  HP_CHECK_ARG(targets.scalar_type() == at::kLong && targets.dim() == 2 &&
                   targets.size(0) == logits.size(0) && targets.size(1) == logits.size(1),
               "cross_entropy: targets must be int64 [", logits.size(0), ", ", logits.size(1),
               "] to match logits ", logits.sizes(), " but got ", targets.scalar_type(),
               " of shape ", targets.sizes());
  const int64_t V = logits.size(2);
  // On the host only where that is free (see GPT::forward); on a GPU the
  // loss kernel's device-side assert stops an out-of-range target.
  if (targets.is_cpu() && targets.numel() > 0) {
    auto [lo, hi] = torch::aminmax(targets);
    const int64_t min_id = lo.item<int64_t>(), max_id = hi.item<int64_t>();
    HP_CHECK_ARG(min_id >= 0 && max_id < V, "cross_entropy: targets must be in [0, ", V,
                 ") but got ", (min_id < 0 ? min_id : max_id));
  }
  return torch::nn::functional::cross_entropy(logits.reshape({-1, V}), targets.reshape({-1}));
}

}  // namespace hp::nn
