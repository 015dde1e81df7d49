#include "tools/hp_train/model.h"

#include <torch/torch.h>

#include "hp/tensor/dtensor_tensor.h"
#include "hp/tp/gpt_plan.h"
#include "hp/tp/llama_plan.h"
#include "hp/util/error.h"

namespace hp::train {

namespace {

// Calls f on the held holder, whichever it is.
template <typename F>
auto visit(const std::variant<nn::GPT, nn::Llama>& model, F&& f) {
  return std::visit([&f](auto holder) { return f(holder); }, model);
}

template <typename Holder>
Holder copied(Holder source) {
  Holder copy(source->config());
  torch::NoGradGuard no_grad;
  auto from = source->named_parameters();
  for (auto& p : copy->named_parameters()) {
    const at::Tensor& value = from[p.key()];
    p.value().copy_(is_dtensor(value) ? full_tensor(value) : value);
  }
  return copy;
}

}  // namespace

nn::GPTConfig gpt_config(const TrainOptions& o, int64_t vocab_size) {
  nn::GPTConfig config;
  config.vocab_size = vocab_size;
  config.context = o.ctx;
  config.n_layer = o.layers;
  config.n_head = o.heads;
  config.n_embd = o.d;
  return config;
}

nn::LlamaConfig llama_config(const TrainOptions& o, int64_t vocab_size) {
  nn::LlamaConfig config;
  config.vocab_size = vocab_size;
  config.context = o.ctx;
  config.n_layer = o.layers;
  config.n_head = o.heads;
  config.n_kv_head = o.kv_heads > 0 ? o.kv_heads : o.heads;
  config.n_embd = o.d;
  config.intermediate_size = nn::llama_intermediate_size(o.d);
  return config;
}

TrainModel TrainModel::build(const TrainOptions& o, int64_t vocab_size, c10::Device device) {
  if (o.model == "gpt") return TrainModel(nn::GPT(gpt_config(o, vocab_size), device));
  HP_CHECK_ARG(o.model == "llama", "--model '", o.model, "' is not a model; expected gpt or llama");
  return TrainModel(nn::Llama(llama_config(o, vocab_size), device));
}

pp::ModelLayout TrainModel::layout() const {
  if (const auto* gpt = std::get_if<nn::GPT>(&model_)) return pp::gpt_layout((*gpt)->config());
  return pp::llama_layout(std::get<nn::Llama>(model_)->config());
}

pp::StageModule TrainModel::stage(const pp::StagePlan& plan, int stage) const {
  // A handle: the stage shares the model's modules, as copies of it do.
  if (const auto* gpt = std::get_if<nn::GPT>(&model_)) return pp::gpt_stage(*gpt->ptr(), plan, stage);
  return pp::llama_stage(*std::get<nn::Llama>(model_).ptr(), plan, stage);
}

nn::InitPlan TrainModel::init_plan() const {
  return visit(model_, [](auto m) { return m->init_plan(); });
}

std::shared_ptr<nn::Module> TrainModel::root() const {
  return visit(model_, [](auto m) { return std::static_pointer_cast<nn::Module>(m.ptr()); });
}

std::vector<std::shared_ptr<nn::Module>> TrainModel::blocks() const {
  std::vector<std::shared_ptr<nn::Module>> out;
  if (const auto* gpt = std::get_if<nn::GPT>(&model_)) {
    for (const auto& block : (*gpt)->blocks()) out.push_back(block.ptr());
  } else {
    for (const auto& layer : std::get<nn::Llama>(model_)->layers()) out.push_back(layer.ptr());
  }
  return out;
}

int64_t TrainModel::embedding_parameter_count() const {
  if (const auto* gpt = std::get_if<nn::GPT>(&model_)) {
    const auto& c = (*gpt)->config();
    return (c.vocab_size + c.context) * c.n_embd;
  }
  const auto& c = std::get<nn::Llama>(model_)->config();
  return c.vocab_size * c.n_embd;
}

int64_t TrainModel::vocab_size() const {
  return visit(model_, [](auto m) { return m->config().vocab_size; });
}

int64_t TrainModel::context() const {
  return visit(model_, [](auto m) { return m->config().context; });
}

const char* TrainModel::name() const {
  return std::holds_alternative<nn::GPT>(model_) ? "GPT" : "Llama";
}

at::Tensor TrainModel::operator()(const at::Tensor& idx) const {
  return visit(model_, [&idx](auto m) { return m(idx); });
}

at::Tensor TrainModel::generate(const at::Tensor& prompt, int64_t max_new_tokens,
                                double temperature, int64_t top_k,
                                at::Generator generator) const {
  return visit(model_, [&](auto m) {
    return m->generate(prompt, max_new_tokens, temperature, top_k, generator);
  });
}

ShardingPlan TrainModel::tensor_parallel_plan(const DeviceMesh& mesh,
                                              const std::string& tp_dim) const {
  if (const auto* gpt = std::get_if<nn::GPT>(&model_)) {
    return gpt_tensor_parallel_plan((*gpt)->config(), mesh, tp_dim);
  }
  return llama_tensor_parallel_plan(std::get<nn::Llama>(model_)->config(), mesh, tp_dim);
}

TrainModel TrainModel::whole_copy() const {
  return visit(model_, [](auto m) { return TrainModel(copied(m)); });
}

}  // namespace hp::train
