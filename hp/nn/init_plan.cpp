#include "hp/nn/init_plan.h"

#include <torch/torch.h>

#include <map>

#include "hp/util/error.h"

namespace hp::nn {

void apply_init_plan(torch::nn::Module& module, const InitPlan& plan) {
  std::map<std::string, at::Tensor> tensors;
  for (const auto& item : module.named_parameters(/*recurse=*/true)) {
    tensors[item.key()] = item.value();
  }
  for (const auto& item : module.named_buffers(/*recurse=*/true)) {
    tensors[item.key()] = item.value();
  }
  for (const InitStep& step : plan) {
    HP_CHECK_ARG(tensors.count(step.name), "apply_init_plan: step '", step.name,
                 "' names no parameter or buffer of ", module.name());
    HP_CHECK_ARG(static_cast<bool>(step.fill), "apply_init_plan: step '", step.name,
                 "' has no fill function");
  }
  torch::NoGradGuard no_grad;
  for (const InitStep& step : plan) step.fill(tensors.at(step.name));
}

InitStep normal_step(std::string name, double mean, double std) {
  return {std::move(name), [mean, std](at::Tensor& t) { t.normal_(mean, std); }};
}

InitStep fill_step(std::string name, double value) {
  return {std::move(name), [value](at::Tensor& t) { t.fill_(value); }};
}

}  // namespace hp::nn
