#include "hp/pp/stage_module.h"

#include <torch/torch.h>

#include <map>
#include <set>

#include "hp/nn/gpt.h"
#include "hp/nn/linear.h"
#include "hp/nn/llama.h"
#include "hp/util/error.h"

namespace hp::pp {

namespace {

std::vector<std::string> split_dots(const std::string& name) {
  std::vector<std::string> parts;
  size_t begin = 0;
  for (size_t dot; (dot = name.find('.', begin)) != std::string::npos; begin = dot + 1)
    parts.push_back(name.substr(begin, dot - begin));
  parts.push_back(name.substr(begin));
  return parts;
}

std::shared_ptr<torch::nn::Module> child(torch::nn::Module& parent, const std::string& name) {
  for (const auto& item : parent.named_children())
    if (item.key() == name) return item.value();
  return nullptr;
}

// The module `whole` holds under `dotted_name`.
std::shared_ptr<torch::nn::Module> find_module(torch::nn::Module& whole,
                                               const std::string& dotted_name) {
  torch::nn::Module* at = &whole;
  std::shared_ptr<torch::nn::Module> found;
  for (const std::string& part : split_dots(dotted_name)) {
    found = child(*at, part);
    HP_CHECK_ARG(found != nullptr, "pipeline stage: the model has no module '", dotted_name, "'");
    at = found.get();
  }
  return found;
}

void check_ids(const at::Tensor& idx, int64_t context, int64_t vocab, const char* what) {
  HP_CHECK_ARG(idx.scalar_type() == at::kLong && idx.dim() == 2, what,
               ": stage 0 takes int64 token ids [B, T] but got ", idx.scalar_type(), " of shape ",
               idx.sizes());
  const int64_t T = idx.size(1);
  HP_CHECK_ARG(T >= 1 && T <= context, what, ": sequence length ", T, " must be in [1, ", context,
               "]");
  // On the host only, as the whole models check (a GPU read-back would
  // stall every micro-batch).
  if (idx.is_cpu() && idx.numel() > 0) {
    auto [lo, hi] = torch::aminmax(idx);
    const int64_t min_id = lo.item<int64_t>(), max_id = hi.item<int64_t>();
    HP_CHECK_ARG(min_id >= 0 && max_id < vocab, what, ": token ids must be in [0, ", vocab,
                 ") but got ", (min_id < 0 ? min_id : max_id));
  }
}

void check_hidden(const at::Tensor& x, int64_t width, int stage, const char* what) {
  HP_CHECK_ARG(x.dim() == 3 && x.size(2) == width && at::isFloatingType(x.scalar_type()), what,
               ": stage ", stage, " takes hidden states [B, T, ", width, "] but got ",
               x.scalar_type(), " of shape ", x.sizes());
}

void check_stage_index(const StagePlan& plan, int stage, const char* what) {
  HP_CHECK_ARG(stage >= 0 && stage < plan.num_stages(), what, ": stage ", stage,
               " out of range for a plan of ", plan.num_stages(), " stages");
}

}  // namespace

StageModuleImpl::StageModuleImpl(int stage, int num_stages, std::vector<std::string> module_names)
    : Module("PipelineStage"),
      stage_(stage),
      num_stages_(num_stages),
      module_names_(std::move(module_names)) {}

void StageModuleImpl::adopt(const std::string& dotted_name,
                            std::shared_ptr<torch::nn::Module> module) {
  std::vector<std::string> parts = split_dots(dotted_name);
  torch::nn::Module* at = this;
  for (size_t i = 0; i + 1 < parts.size(); ++i) {
    std::shared_ptr<torch::nn::Module> next = child(*at, parts[i]);
    // A plain container, as "h" is a ModuleList in the whole model: it only
    // carries the name.
    if (!next) next = at->register_module(parts[i], std::make_shared<torch::nn::Module>(parts[i]));
    at = next.get();
  }
  at->register_module(parts.back(), std::move(module));
}

void StageModuleImpl::set_calls(Call prologue, std::vector<std::shared_ptr<nn::Module>> blocks,
                                std::vector<Call> block_calls, Call epilogue) {
  prologue_ = std::move(prologue);
  blocks_ = std::move(blocks);
  block_calls_ = std::move(block_calls);
  epilogue_ = std::move(epilogue);
}

at::Tensor StageModuleImpl::forward(const at::Tensor& input) {
  at::Tensor x = prologue_ ? prologue_(input) : input;
  for (const Call& block : block_calls_) x = block(x);
  return epilogue_ ? epilogue_(x) : x;
}

StageModule gpt_stage(nn::GPTImpl& whole, const StagePlan& plan, int stage) {
  const nn::GPTConfig config = whole.config();
  check_stage_plan(gpt_layout(config), plan);
  check_stage_index(plan, stage, "gpt_stage");
  StageModule module(stage, plan.num_stages(), plan.stages[stage]);
  StageModuleImpl* self = module.get();
  std::vector<std::shared_ptr<nn::Module>> blocks;
  std::vector<StageModuleImpl::Call> calls;
  for (const std::string& name : plan.stages[stage]) {
    module->adopt(name, find_module(whole, name));
    if (name.rfind("h.", 0) == 0) {
      nn::Block block = whole.blocks().at(std::stoul(name.substr(2)));
      blocks.push_back(block.ptr());
      calls.push_back([block](const at::Tensor& x) mutable { return block(x); });
    }
  }
  StageModuleImpl::Call prologue, epilogue;
  if (module->is_first()) {
    prologue = [self, config, wte = whole.wte, wpe = whole.wpe](const at::Tensor& idx) mutable {
      check_ids(idx, config.context, config.vocab_size, "GPT pipeline stage");
      at::Tensor x = wte(idx) + wpe(torch::arange(idx.size(1), idx.options()));
      if (config.dropout > 0 && self->is_training())
        x = torch::dropout(x, config.dropout, /*train=*/true);
      return x;
    };
  } else {
    const int index = stage;
    prologue = [config, index](const at::Tensor& x) {
      check_hidden(x, config.n_embd, index, "GPT pipeline stage");
      return x;
    };
  }
  if (module->is_last()) {
    epilogue = [ln_f = whole.ln_f, lm_head = whole.lm_head](const at::Tensor& x) mutable {
      return nn::linear(lm_head, ln_f(x));
    };
  }
  module->set_calls(std::move(prologue), std::move(blocks), std::move(calls), std::move(epilogue));
  return module;
}

StageModule llama_stage(nn::LlamaImpl& whole, const StagePlan& plan, int stage) {
  const nn::LlamaConfig config = whole.config();
  check_stage_plan(llama_layout(config), plan);
  check_stage_index(plan, stage, "llama_stage");
  StageModule module(stage, plan.num_stages(), plan.stages[stage]);
  std::vector<std::shared_ptr<nn::Module>> blocks;
  std::vector<StageModuleImpl::Call> calls;
  const std::string layer_prefix = "model.layers.";
  for (const std::string& name : plan.stages[stage]) {
    module->adopt(name, find_module(whole, name));
    if (name.rfind(layer_prefix, 0) == 0) {
      nn::LlamaDecoderLayer layer = whole.layers().at(std::stoul(name.substr(layer_prefix.size())));
      blocks.push_back(layer.ptr());
      calls.push_back([layer](const at::Tensor& x) mutable { return layer(x); });
    }
  }
  StageModuleImpl::Call prologue, epilogue;
  if (module->is_first()) {
    prologue = [config, embed = whole.model->embed_tokens](const at::Tensor& idx) mutable {
      check_ids(idx, config.context, config.vocab_size, "Llama pipeline stage");
      return embed(idx);
    };
  } else {
    const int index = stage;
    prologue = [config, index](const at::Tensor& x) {
      check_hidden(x, config.n_embd, index, "Llama pipeline stage");
      return x;
    };
  }
  if (module->is_last()) {
    epilogue = [norm = whole.model->norm, lm_head = whole.lm_head](const at::Tensor& x) mutable {
      return nn::linear(lm_head, norm(x));
    };
  }
  module->set_calls(std::move(prologue), std::move(blocks), std::move(calls), std::move(epilogue));
  return module;
}

nn::InitPlan stage_init_plan(const torch::nn::Module& whole, const nn::InitPlan& whole_plan,
                             const StageModuleImpl& stage_module) {
  std::set<std::string> own;
  for (const auto& item : stage_module.named_parameters()) own.insert(item.key());
  for (const auto& item : stage_module.named_buffers()) own.insert(item.key());
  struct Shape {
    std::vector<int64_t> sizes;
    at::ScalarType dtype;
  };
  std::map<std::string, Shape> shapes;
  for (const auto& item : whole.named_parameters())
    shapes[item.key()] = {item.value().sizes().vec(), item.value().scalar_type()};
  for (const auto& item : whole.named_buffers())
    shapes[item.key()] = {item.value().sizes().vec(), item.value().scalar_type()};

  nn::InitPlan plan;
  std::vector<nn::InitStep> pending;  // other stages' steps not yet folded in
  // Runs `elsewhere`'s draws, each into a scratch tensor of its tensor's
  // shape on the CPU (where init_sharded draws), then `own`'s fill.
  auto fold = [](std::vector<nn::InitStep> elsewhere, std::vector<Shape> their_shapes,
                 std::function<void(at::Tensor&)> own_fill) {
    return [elsewhere = std::move(elsewhere), their_shapes = std::move(their_shapes),
            own_fill = std::move(own_fill)](at::Tensor& tensor) {
      for (size_t i = 0; i < elsewhere.size(); ++i) {
        at::Tensor scratch =
            at::empty(their_shapes[i].sizes, at::TensorOptions(their_shapes[i].dtype));
        elsewhere[i].fill(scratch);
      }
      if (own_fill) own_fill(tensor);
    };
  };
  auto shapes_of = [&](const std::vector<nn::InitStep>& steps) {
    std::vector<Shape> result;
    for (const nn::InitStep& step : steps) {
      auto it = shapes.find(step.name);
      HP_CHECK_ARG(it != shapes.end(), "stage_init_plan: step '", step.name,
                   "' names no parameter or buffer of the whole model");
      result.push_back(it->second);
    }
    return result;
  };
  for (const nn::InitStep& step : whole_plan) {
    if (!own.count(step.name)) {
      pending.push_back(step);
      continue;
    }
    if (pending.empty()) {
      plan.push_back(step);
    } else {
      std::vector<Shape> their = shapes_of(pending);
      plan.push_back({step.name, fold(std::move(pending), std::move(their), step.fill)});
      pending.clear();
    }
  }
  // Draws after the stage's last step still run, so the generator leaves
  // init in the state the whole model's init leaves it in.
  if (!pending.empty()) {
    HP_CHECK_ARG(!plan.empty(), "stage_init_plan: no step names a tensor of stage ",
                 stage_module.stage());
    std::vector<Shape> their = shapes_of(pending);
    nn::InitStep& last = plan.back();
    auto then_drop = fold(std::move(pending), std::move(their), nullptr);
    last.fill = [first = last.fill, then_drop](at::Tensor& tensor) {
      first(tensor);
      at::Tensor none;
      then_drop(none);
    };
  }
  return plan;
}

}  // namespace hp::pp
