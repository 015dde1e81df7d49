#include "tests/nn/gpt_sensitivity.h"

#include <torch/torch.h>

#include <algorithm>

#include "hp/nn/loss.h"

namespace hp::nn {

Named forward_backward(GPT& model, const at::Tensor& idx, const at::Tensor& targets) {
  model->zero_grad();
  at::Tensor logits = model(idx);
  at::Tensor loss = cross_entropy(logits, targets);
  loss.backward();
  Named out{{"logits", logits.detach()}, {"loss", loss.detach()}};
  for (const auto& p : model->named_parameters()) {
    out.emplace("grad." + p.key(), p.value().grad().clone());
  }
  return out;
}

GPT copy_of(GPT& source, const GPTConfig& config, at::ScalarType dtype) {
  GPT copy(config);
  copy->to(dtype);
  torch::NoGradGuard no_grad;
  auto from = source->named_parameters();
  for (auto& p : copy->named_parameters()) p.value().copy_(from[p.key()]);
  return copy;
}

Sensitivity measure_sensitivity(GPT& model, const GPTConfig& config, const at::Tensor& idx,
                                const at::Tensor& targets) {
  GPT probe = copy_of(model, config, at::kDouble);
  Sensitivity s{forward_backward(probe, idx, targets), {}};
  Named original;
  for (const auto& p : probe->named_parameters()) original.emplace(p.key(), p.value().clone());
  auto gen = at::detail::createCPUGenerator(7);
  for (int draw = 0; draw < kProbeDraws; ++draw) {
    {
      torch::NoGradGuard no_grad;
      for (auto& p : probe->named_parameters()) {
        at::Tensor sign = torch::randint(2, p.value().sizes(), gen, torch::kDouble) * 2 - 1;
        p.value().copy_(original.at(p.key()) * (1 + kProbe * sign));
      }
    }
    Named moved = forward_backward(probe, idx, targets);
    for (const auto& [name, value] : s.base) {
      const double change = (moved.at(name) - value).abs().max().item<double>() / kProbe;
      s.per_unit[name] = std::max(s.per_unit[name], change);
    }
  }
  return s;
}

}  // namespace hp::nn
