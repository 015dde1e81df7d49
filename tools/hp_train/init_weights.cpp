#include "tools/hp_train/init_weights.h"

#include <torch/torch.h>

#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <map>
#include <vector>

#include "hp/checkpoint/safetensors.h"
#include "hp/util/error.h"
#include "hp/util/format.h"
#include "tools/hp_train/progress.h"

namespace hp::train {
namespace {

// What GPT the tensors look like, from GPT-2's names: wte.weight [vocab, d],
// wpe.weight [ctx, d], blocks h.0. to h.<L-1>.
std::string file_shape(const std::vector<std::pair<std::string, at::Tensor>>& tensors) {
  int64_t layers = 0, d = -1, ctx = -1, vocab = -1;
  for (const auto& [name, value] : tensors) {
    if (name == "wte.weight" && value.dim() == 2) {
      vocab = value.size(0);
      d = value.size(1);
    } else if (name == "wpe.weight" && value.dim() == 2) {
      ctx = value.size(0);
    } else if (name.rfind("h.", 0) == 0) {
      const size_t dot = name.find('.', 2);
      int64_t index = 0;
      if (dot != std::string::npos &&
          std::from_chars(name.data() + 2, name.data() + dot, index).ec == std::errc()) {
        layers = std::max(layers, index + 1);
      }
    }
  }
  if (d < 0 || ctx < 0) {
    return fmt::format("the file holds {} and no GPT-2 embeddings (wte.weight, wpe.weight)",
                       plural(static_cast<int64_t>(tensors.size()), "tensor"));
  }
  return fmt::format("the file looks like a GPT of {}, d {}, ctx {}, vocab {} (--layers {} --d {} "
                     "--ctx {})",
                     plural(layers, "layer"), d, ctx, vocab, layers, d, ctx);
}

}  // namespace

void load_initial_weights(torch::nn::Module& model, const std::string& path) {
  checkpoint::SafetensorsFile file;
  try {
    file = checkpoint::read_safetensors(path);
  } catch (const checkpoint::SafetensorsError& e) {
    throw_argument_error(fmt::format("--init-from: {}", e.what()));
  }
  std::map<std::string, at::Tensor> loaded(file.tensors.begin(), file.tensors.end());

  std::vector<std::string> problems;
  std::vector<std::pair<at::Tensor, at::Tensor>> copies;  // (parameter, value)
  for (const auto& item : model.named_parameters(/*recurse=*/true)) {
    const at::Tensor& param = item.value();
    auto it = loaded.find(item.key());
    if (it == loaded.end()) {
      problems.push_back(fmt::format("missing tensor '{}' (expected shape {})", item.key(),
                                     to_string(param.sizes().vec())));
      continue;
    }
    const at::Tensor& value = it->second;
    if (value.sizes() != param.sizes()) {
      problems.push_back(fmt::format("tensor '{}' has shape {}, expected {}", item.key(),
                                     to_string(value.sizes().vec()),
                                     to_string(param.sizes().vec())));
    } else if (!at::isFloatingType(value.scalar_type())) {
      problems.push_back(fmt::format("tensor '{}' has dtype {}, expected a floating dtype ({})",
                                     item.key(), c10::toString(value.scalar_type()),
                                     c10::toString(param.scalar_type())));
    } else {
      copies.emplace_back(param, value);
    }
    loaded.erase(it);
  }
  for (const auto& [name, value] : loaded) {
    problems.push_back(fmt::format("unexpected tensor '{}' of shape {} (not a parameter of the "
                                   "model)",
                                   name, to_string(value.sizes().vec())));
  }
  if (!problems.empty()) {
    // A file of another model mismatches in nearly every tensor: list a
    // few, count the rest, and say which shape the file holds.
    constexpr size_t kListed = 5;
    std::string message = fmt::format(
        "--init-from '{}' does not match the model: {}{}", path,
        plural(static_cast<int64_t>(problems.size()), "problem"),
        problems.size() > kListed ? fmt::format(", the first {}", kListed) : "");
    for (size_t i = 0; i < std::min(problems.size(), kListed); ++i) {
      message += "\n  " + problems[i];
    }
    if (problems.size() > kListed) {
      message += fmt::format("\n  ... and {} more", problems.size() - kListed);
    }
    message += "\n" + file_shape(file.tensors) +
               "; --layers/--d/--heads/--ctx (and the corpus's vocabulary) set the model";
    throw_argument_error(message);
  }
  torch::NoGradGuard no_grad;
  for (auto& [param, value] : copies) param.copy_(value);
}

}  // namespace hp::train
