#include "hp/checkpoint/training_state.h"

#include "hp/checkpoint/adamw_state.h"

#include <torch/torch.h>

#include <ATen/CPUGeneratorImpl.h>

#include <map>

#include "hp/fsdp/state_dict.h"
#include "hp/nn/module.h"
#include "hp/tensor/dtensor_tensor.h"
#include "hp/util/error.h"
#include "hp/util/torch_compat.h"

namespace hp::checkpoint {

void add_model(State& state, const nn::Module& model, const std::string& prefix) {
  for (auto& [name, value] : get_model_state_dict(model)) {
    if (std::holds_alternative<DTensor>(value)) {
      state.add(prefix + name, std::get<DTensor>(value));
    } else {
      state.add(prefix + name, std::get<at::Tensor>(value));
    }
  }
}

bool adamw_uses_amsgrad(const torch::optim::AdamW& optimizer) {
  bool amsgrad = false;
  for (const auto& group : optimizer.param_groups()) {
    amsgrad = amsgrad || static_cast<const torch::optim::AdamWOptions&>(group.options()).amsgrad();
  }
  return amsgrad;
}

torch::optim::AdamWParamState& adamw_param_state(torch::optim::AdamW& optimizer,
                                                 const at::Tensor& param, bool amsgrad) {
  auto& states = optimizer.state();
  const auto key = compat::optimizer_state_key(param);
  auto it = states.find(key);
  if (it == states.end()) {
    // What AdamW::step creates for a parameter it meets the first time.
    auto fresh = std::make_unique<torch::optim::AdamWParamState>();
    fresh->step(0);
    fresh->exp_avg(torch::zeros_like(param, at::MemoryFormat::Preserve));
    fresh->exp_avg_sq(torch::zeros_like(param, at::MemoryFormat::Preserve));
    if (amsgrad) fresh->max_exp_avg_sq(torch::zeros_like(param, at::MemoryFormat::Preserve));
    it = states.emplace(key, std::move(fresh)).first;
  }
  return static_cast<torch::optim::AdamWParamState&>(*it->second);
}

void add_adamw(State& state, torch::optim::AdamW& optimizer, const nn::Module& model,
               const std::string& prefix) {
  std::map<std::string, StateValue> layouts;
  for (auto& [name, value] : get_model_state_dict(model)) layouts.emplace(name, value);
  const bool amsgrad = adamw_uses_amsgrad(optimizer);
  std::vector<std::pair<torch::optim::AdamWParamState*, at::Tensor>> steps;
  for (const auto& item : model.named_parameters(/*recurse=*/true)) {
    auto& s = adamw_param_state(optimizer, item.value(), amsgrad);
    const std::string base = prefix + item.key();
    const StateValue& value = layouts.at(item.key());
    auto add_like_param = [&](const std::string& suffix, const at::Tensor& t) {
      // The state of a tensor-form DTensor parameter is one too (tensor
      // parallelism, alone or under fully_shard): it carries its layout.
      if (is_dtensor(t)) {
        state.add(base + suffix, t);
      } else if (std::holds_alternative<DTensor>(value)) {
        const DTensor& d = std::get<DTensor>(value);
        state.add(base + suffix, t, d.layout(), d.sizes());
      } else {
        state.add(base + suffix, t);
      }
    };
    add_like_param(".exp_avg", s.exp_avg());
    add_like_param(".exp_avg_sq", s.exp_avg_sq());
    if (amsgrad) add_like_param(".max_exp_avg_sq", s.max_exp_avg_sq());
    at::Tensor step = torch::tensor(s.step(), torch::kLong);
    state.add(base + ".step", step);
    steps.emplace_back(&s, step);
  }
  state.on_loaded([steps] {
    for (const auto& [s, step] : steps) s->step(step.item<int64_t>());
  });
}

void add_int(State& state, const std::string& key, int64_t& value) {
  at::Tensor holder = torch::tensor(value, torch::kLong);
  state.add(key, holder);
  int64_t* target = &value;
  state.on_loaded([holder, target] { *target = holder.item<int64_t>(); });
}

void add_cpu_rng(State& state, const std::string& key) {
  at::Generator generator = at::detail::getDefaultCPUGenerator();
  at::Tensor holder;
  {
    std::lock_guard<std::mutex> lock(generator.mutex());
    holder = generator.get_state();
  }
  state.add(key, holder);
  state.on_loaded([holder] {
    at::Generator g = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(g.mutex());
    g.set_state(holder);
  });
}

}  // namespace hp::checkpoint
