// Autoregressive sampling for any language model given as a function from
// ids to logits (N2, N5 in docs/features.md): GPT::generate and
// Llama::generate are this over their forward.
#pragma once

#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <string>

namespace hp::nn {

// ids int64 [B, T] -> logits [B, T, vocab]
using LogitsFunction = std::function<at::Tensor(const at::Tensor& ids)>;

// Appends max_new_tokens sampled tokens to idx [B, T0] and returns
// [B, T0 + max_new_tokens]. Each step feeds the last `context` tokens to
// `logits_of`, divides the last position's logits by temperature (> 0),
// keeps the top_k largest (0 = all) and samples with `generator` (an
// undefined generator means torch's default one), on the generator's device:
// a CPU generator serves a model on a GPU. Runs without autograd.
// Bad arguments throw hp::ArgumentError whose message starts with `caller`.
at::Tensor sample_tokens(const LogitsFunction& logits_of, int64_t context, at::Tensor idx,
                         int64_t max_new_tokens, double temperature, int64_t top_k,
                         at::Generator generator, const std::string& caller);

}  // namespace hp::nn
