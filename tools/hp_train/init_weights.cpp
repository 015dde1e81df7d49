#include "tools/hp_train/init_weights.h"

#include <torch/torch.h>

#include <map>
#include <vector>

#include "hp/checkpoint/safetensors.h"
#include "hp/util/error.h"
#include "hp/util/format.h"

namespace hp::train {

void load_initial_weights(torch::nn::Module& model, const std::string& path) {
  checkpoint::SafetensorsFile file;
  try {
    file = checkpoint::read_safetensors(path);
  } catch (const checkpoint::SafetensorsError& e) {
    throw_argument_error(cat("--init-from: ", e.what()));
  }
  std::map<std::string, at::Tensor> loaded(file.tensors.begin(), file.tensors.end());

  std::vector<std::string> problems;
  std::vector<std::pair<at::Tensor, at::Tensor>> copies;  // (parameter, value)
  for (const auto& item : model.named_parameters(/*recurse=*/true)) {
    const at::Tensor& param = item.value();
    auto it = loaded.find(item.key());
    if (it == loaded.end()) {
      problems.push_back(cat("missing tensor '", item.key(), "' (expected shape ",
                             to_string(param.sizes().vec()), ")"));
      continue;
    }
    const at::Tensor& value = it->second;
    if (value.sizes() != param.sizes()) {
      problems.push_back(cat("tensor '", item.key(), "' has shape ",
                             to_string(value.sizes().vec()), ", expected ",
                             to_string(param.sizes().vec())));
    } else if (!at::isFloatingType(value.scalar_type())) {
      problems.push_back(cat("tensor '", item.key(), "' has dtype ", value.scalar_type(),
                             ", expected a floating dtype (", param.scalar_type(), ")"));
    } else {
      copies.emplace_back(param, value);
    }
    loaded.erase(it);
  }
  for (const auto& [name, value] : loaded) {
    problems.push_back(cat("unexpected tensor '", name, "' of shape ",
                           to_string(value.sizes().vec()), " (not a parameter of the model)"));
  }
  if (!problems.empty()) {
    std::string message = cat("--init-from '", path, "' does not match the model (",
                              "check --layers/--d/--heads/--ctx/--vocab):");
    for (const auto& p : problems) message += "\n  " + p;
    throw_argument_error(message);
  }
  torch::NoGradGuard no_grad;
  for (auto& [param, value] : copies) param.copy_(value);
}

}  // namespace hp::train
