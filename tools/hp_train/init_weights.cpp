#include "tools/hp_train/init_weights.h"

#include <torch/torch.h>

#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <map>
#include <new>
#include <vector>

#include "hp/checkpoint/safetensors.h"
#include "hp/util/error.h"
#include "hp/util/format.h"
#include "tools/hp_train/progress.h"

namespace hp::train {
namespace {

// A tensor of the file, as its header describes it.
struct FileTensor {
  std::string name;
  std::vector<int64_t> shape;
  at::ScalarType dtype;
};

// What GPT the tensors look like, from GPT-2's names: wte.weight [vocab, d],
// wpe.weight [ctx, d], blocks h.0. to h.<L-1>.
std::string file_shape(const std::vector<FileTensor>& tensors) {
  int64_t layers = 0, d = -1, ctx = -1, vocab = -1;
  for (const auto& [name, shape, dtype] : tensors) {
    if (name == "wte.weight" && shape.size() == 2) {
      vocab = shape[0];
      d = shape[1];
    } else if (name == "wpe.weight" && shape.size() == 2) {
      ctx = shape[0];
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

// Every way the file's tensors fail to match `model`'s parameters, as an
// ArgumentError (nothing when they match).
void check_against(const torch::nn::Module& model, const std::string& path,
                   const std::vector<FileTensor>& tensors) {
  std::map<std::string, const FileTensor*> loaded;
  for (const FileTensor& t : tensors) loaded[t.name] = &t;
  std::vector<std::string> problems;
  for (const auto& item : model.named_parameters(/*recurse=*/true)) {
    const at::Tensor& param = item.value();
    auto it = loaded.find(item.key());
    if (it == loaded.end()) {
      problems.push_back(fmt::format("missing tensor '{}' (expected shape {})", item.key(),
                                     to_string(param.sizes().vec())));
      continue;
    }
    const FileTensor& value = *it->second;
    if (value.shape != param.sizes().vec()) {
      problems.push_back(fmt::format("tensor '{}' has shape {}, expected {}", item.key(),
                                     to_string(value.shape), to_string(param.sizes().vec())));
    } else if (!at::isFloatingType(value.dtype)) {
      problems.push_back(fmt::format("tensor '{}' has dtype {}, expected a floating dtype ({})",
                                     item.key(), c10::toString(value.dtype),
                                     c10::toString(param.scalar_type())));
    }
    loaded.erase(it);
  }
  for (const auto& [name, value] : loaded) {
    problems.push_back(fmt::format("unexpected tensor '{}' of shape {} (not a parameter of the "
                                   "model)",
                                   name, to_string(value->shape)));
  }
  if (problems.empty()) return;
  // A file of another model mismatches in nearly every tensor: list a few,
  // count the rest, and say which shape the file holds.
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
  message += "\n" + file_shape(tensors) +
             "; --layers/--d/--heads/--ctx (and the corpus's vocabulary) set the model";
  throw_argument_error(message);
}

// The header of `path`, its errors as ArgumentErrors naming the file.
checkpoint::SafetensorsIndex read_index(const std::string& path) {
  try {
    return checkpoint::read_safetensors_index(path);
  } catch (const checkpoint::SafetensorsError& e) {
    throw_argument_error(fmt::format("--init-from: {}", e.what()));
  }
}

std::vector<FileTensor> described(const checkpoint::SafetensorsIndex& index) {
  std::vector<FileTensor> out;
  for (const auto& e : index.entries) out.push_back({e.name, e.shape, e.dtype});
  return out;
}

}  // namespace

void load_initial_weights(torch::nn::Module& model, const std::string& path) {
  // The names, shapes and dtypes first, from the header alone: a file of
  // another model is refused before its data is read (it may not even fit
  // in memory).
  check_against(model, path, described(read_index(path)));
  checkpoint::SafetensorsFile file;
  try {
    file = checkpoint::read_safetensors(path);
  } catch (const checkpoint::SafetensorsError& e) {
    throw_argument_error(fmt::format("--init-from: {}", e.what()));
  } catch (const std::bad_alloc&) {
    throw_argument_error(
        fmt::format("--init-from '{}': its tensors do not fit in this process's memory", path));
  }
  // Again on what was read: the file may have been replaced in between.
  std::vector<FileTensor> read;
  for (const auto& [name, value] : file.tensors) {
    read.push_back({name, value.sizes().vec(), value.scalar_type()});
  }
  check_against(model, path, read);
  std::map<std::string, at::Tensor> loaded(file.tensors.begin(), file.tensors.end());
  torch::NoGradGuard no_grad;
  for (const auto& item : model.named_parameters(/*recurse=*/true)) {
    at::Tensor param = item.value();
    param.copy_(loaded.at(item.key()));
  }
}

void check_initial_weights(const torch::nn::Module& model, const std::string& path) {
  const checkpoint::SafetensorsIndex index = read_index(path);
  check_against(model, path, described(index));
  // Kept alive for the loop: find() points into the dict named_parameters
  // returns, so a temporary one would leave `param` dangling.
  const auto params = model.named_parameters(/*recurse=*/true);
  for (const auto& e : index.entries) {
    const at::Tensor* param = params.find(e.name);
    HP_CHECK_ARG(param && param->scalar_type() == e.dtype, "--init-from '", path,
                 "': tensor '", e.name, "' has dtype ", c10::toString(e.dtype),
                 "; reading straight into the shards (--init meta) needs the parameters' dtype ",
                 param ? c10::toString(param->scalar_type()) : "",
                 " (--init eager converts)");
  }
}

}  // namespace hp::train
