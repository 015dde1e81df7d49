#include "hp/nn/sample_tokens.h"

#include <torch/torch.h>

#include <cmath>
#include <limits>

#include "hp/util/error.h"

namespace hp::nn {

at::Tensor sample_tokens(const LogitsFunction& logits_of, int64_t context, at::Tensor idx,
                         int64_t max_new_tokens, double temperature, int64_t top_k,
                         at::Generator generator, const std::string& caller) {
  HP_CHECK_ARG(idx.scalar_type() == at::kLong && idx.dim() == 2 && idx.size(1) >= 1, caller,
               ": idx must be an int64 [B, T0] tensor with T0 >= 1 but got ", idx.scalar_type(),
               " of shape ", idx.sizes());
  HP_CHECK_ARG(max_new_tokens >= 0, caller, ": max_new_tokens ", max_new_tokens,
               " must be non-negative");
  HP_CHECK_ARG(temperature > 0 && std::isfinite(temperature), caller, ": temperature ",
               temperature, " must be positive and finite");
  HP_CHECK_ARG(top_k >= 0, caller, ": top_k ", top_k, " must be non-negative (0 = off)");
  HP_CHECK_ARG(context >= 1, caller, ": context ", context, " must be at least 1");

  torch::NoGradGuard no_grad;
  for (int64_t step = 0; step < max_new_tokens; ++step) {
    at::Tensor window =
        idx.size(1) <= context ? idx : idx.narrow(1, idx.size(1) - context, context);
    at::Tensor logits = logits_of(window).select(1, -1) / temperature;  // [B, vocab]
    if (top_k > 0 && top_k < logits.size(-1)) {
      at::Tensor kth = std::get<0>(logits.topk(top_k, /*dim=*/-1)).narrow(-1, top_k - 1, 1);
      logits = logits.masked_fill(logits < kth, -std::numeric_limits<double>::infinity());
    }
    // The draw happens where the generator is (a CPU generator for a model
    // on a GPU: every rank, holding the same logits, draws the same tokens);
    // the probabilities go there, the token comes back.
    at::Tensor probs = logits.softmax(-1);
    if (generator.defined() && probs.device() != generator.device()) {
      probs = probs.to(generator.device());
    }
    at::Tensor next = torch::multinomial(probs, /*num_samples=*/1, /*replacement=*/false,
                                         generator);
    idx = torch::cat({idx, next.to(idx.device())}, /*dim=*/1);
  }
  return idx;
}

}  // namespace hp::nn
