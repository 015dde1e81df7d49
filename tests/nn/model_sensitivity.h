// The rounding-bound measurement of tests/nn/gpt_sensitivity.h for any
// language model holder (hp::nn::Llama here): the same derivation, the
// same probe (every parameter scaled by 1 ± kProbe with random signs,
// kProbeDraws draws, float64), written once over the holder's type.
// `Holder` is an HP_MODULE holder whose Impl is built from a `Config` and
// whose call maps ids [B, T] to logits [B, T, vocab].
#pragma once

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include <algorithm>
#include <map>
#include <string>

#include "hp/nn/loss.h"

namespace hp::test {

constexpr double kSensitivityProbe = 0x1p-30;
constexpr int kSensitivityDraws = 8;

using NamedTensors = std::map<std::string, at::Tensor>;

// The logits, the loss and every parameter's gradient ("grad." + name).
template <typename Holder>
NamedTensors forward_backward_of(Holder& model, const at::Tensor& idx,
                                 const at::Tensor& targets) {
  model->zero_grad();
  at::Tensor logits = model(idx);
  at::Tensor loss = nn::cross_entropy(logits, targets);
  loss.backward();
  NamedTensors out{{"logits", logits.detach()}, {"loss", loss.detach()}};
  for (const auto& p : model->named_parameters()) {
    out.emplace("grad." + p.key(), p.value().grad().clone());
  }
  return out;
}

// A model of `config` in `dtype` holding `source`'s parameters.
template <typename Holder, typename Config>
Holder model_copy(Holder& source, const Config& config, at::ScalarType dtype) {
  Holder copy(config);
  copy->to(dtype);
  torch::NoGradGuard no_grad;
  auto from = source->named_parameters();
  for (auto& p : copy->named_parameters()) p.value().copy_(from[p.key()]);
  return copy;
}

struct ModelSensitivity {
  NamedTensors base;                     // float64 results at the model's parameters
  std::map<std::string, double> per_unit;  // S per compared tensor
};

template <typename Holder, typename Config>
ModelSensitivity model_sensitivity(Holder& model, const Config& config, const at::Tensor& idx,
                                   const at::Tensor& targets) {
  Holder probe = model_copy(model, config, at::kDouble);
  ModelSensitivity s{forward_backward_of(probe, idx, targets), {}};
  NamedTensors original;
  for (const auto& p : probe->named_parameters()) original.emplace(p.key(), p.value().clone());
  auto gen = at::detail::createCPUGenerator(7);
  for (int draw = 0; draw < kSensitivityDraws; ++draw) {
    {
      torch::NoGradGuard no_grad;
      for (auto& p : probe->named_parameters()) {
        at::Tensor sign = torch::randint(2, p.value().sizes(), gen, torch::kDouble) * 2 - 1;
        p.value().copy_(original.at(p.key()) * (1 + kSensitivityProbe * sign));
      }
    }
    NamedTensors moved = forward_backward_of(probe, idx, targets);
    for (const auto& entry : s.base) {
      const double change =
          (moved.at(entry.first) - entry.second).abs().max().item<double>() / kSensitivityProbe;
      s.per_unit[entry.first] = std::max(s.per_unit[entry.first], change);
    }
  }
  return s;
}

}  // namespace hp::test
