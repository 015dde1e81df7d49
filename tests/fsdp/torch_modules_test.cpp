// A model written with libtorch's own modules, sharded by calls only (N1):
// torch::nn::Embedding, torch::nn::TransformerEncoderLayers (dropout 0) in
// an hp::nn::Sequential and a torch::nn::Linear head, in a user's own
// torch::nn::Module made hookable with hp::nn::hooked. fully_shard on each
// layer and on the root, with and without activation checkpointing on the
// layers, trains 3 AdamW steps like the same model in this process;
// shard_module lays out an hp::nn::Sequential of torch::nn::Linears by
// plan; and a unit that nothing calls through its hooks is refused naming
// it.
//
// Tolerances are derived as in parity_test.cpp (data_parallel_reference.h):
// each rank computes its rows bit for bit as the reference computes that
// part (the gathered parameters are the reference's values, the kernels the
// same), so the runs differ only in the order the gradient collectives add
// the ranks' parts. The shard_module case uses tp_mlp.h's bounds.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "hp/distributed/world.h"
#include "hp/fsdp/fully_shard.h"
#include "hp/nn/activation_checkpoint.h"
#include "hp/nn/hooked.h"
#include "hp/nn/sequential.h"
#include "hp/tp/shard_module.h"
#include "hp/util/error.h"
#include "tests/fsdp/data_parallel_reference.h"
#include "tests/fsdp/fsdp_test_util.h"
#include "tests/support/tensor_checks.h"
#include "tests/tp/tp_mlp.h"
#include "tests/tp/tp_test_util.h"

namespace hp {
namespace {

using testing::HasSubstr;

constexpr int64_t kVocab = 11, kDim = 8, kSeq = 5, kBatch = 12;

// A user's model, libtorch modules only but for the container.
struct TorchLMImpl : torch::nn::Module {
  explicit TorchLMImpl(int64_t layers) {
    embed = register_module("embed", torch::nn::Embedding(kVocab, kDim));
    blocks = register_module("blocks", nn::Sequential());
    for (int64_t i = 0; i < layers; ++i) {
      blocks->push_back(torch::nn::TransformerEncoderLayer(
          torch::nn::TransformerEncoderLayerOptions(kDim, 2)
              .dim_feedforward(2 * kDim)
              .dropout(0.0)));
    }
    head = register_module("head", torch::nn::Linear(kDim, kVocab));
  }
  // tokens [B, S] -> logits [B, S, vocab]; the layers take [S, B, dim].
  at::Tensor forward(const at::Tensor& tokens) {
    at::Tensor x = blocks(embed(tokens).transpose(0, 1));
    return head(x.transpose(0, 1));
  }
  torch::nn::Embedding embed{nullptr};
  nn::Sequential blocks{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(TorchLM);

using Model = nn::Hooked<TorchLMImpl>;

Model make_model() {
  torch::manual_seed(3);
  return nn::hooked(TorchLM(2));
}

at::Tensor lm_loss(const at::Tensor& logits, const at::Tensor& targets) {
  return torch::nn::functional::cross_entropy(logits.reshape({-1, kVocab}), targets.reshape(-1));
}

test::AdamWHyper adamw_hyper() { return {1e-2, 0.9, 0.95, 1e-8, 0.1}; }

torch::optim::AdamW make_optimizer(const std::vector<at::Tensor>& params) {
  const test::AdamWHyper h = adamw_hyper();
  return torch::optim::AdamW(params, torch::optim::AdamWOptions(h.lr)
                                         .betas({h.beta1, h.beta2})
                                         .eps(h.eps)
                                         .weight_decay(h.weight_decay));
}

TEST(TorchModules, TransformerLayersTrainLikeOneProcess) {
  const int64_t rank = dist::get_rank(), world = dist::get_world_size();
  for (bool checkpointed : {false, true}) {
    SCOPED_TRACE(checkpointed ? "activation checkpointing" : "no checkpointing");
    Model reference = make_model();
    Model model = make_model();
    // The names are the unwrapped model's, as a checkpoint has them.
    EXPECT_EQ(model->named_parameters().keys(), model->wrapped()->named_parameters().keys());
    EXPECT_NE(model->named_parameters().find("blocks.1.self_attn.in_proj_weight"), nullptr);
    FullyShardOptions options;
    options.mesh = test::data_parallel_mesh({world});
    for (const auto& block : *model->wrapped()->blocks) {
      if (checkpointed) nn::set_activation_checkpointing(*block);
      fully_shard(block, options);
    }
    fully_shard(model.ptr(), options);
    auto ref_opt = make_optimizer(reference->parameters());
    auto opt = make_optimizer(model->parameters());
    test::AdamWBound adam(adamw_hyper());
    for (int step = 0; step < 3; ++step) {
      SCOPED_TRACE("step " + std::to_string(step));
      test::copy_parameters(model, reference);
      at::Generator gen = at::detail::createCPUGenerator(700 + step);
      const at::Tensor tokens = at::randint(kVocab, {kBatch, kSeq}, gen);
      const at::Tensor targets = at::randint(kVocab, {kBatch, kSeq}, gen);
      at::Tensor ref_loss = test::data_parallel_backward(
          reference->parameters(), reference->parameters(), world, [&](int64_t part) {
            return lm_loss(reference(test::rows_for(tokens, part, world)),
                           test::rows_for(targets, part, world));
          });
      at::Tensor loss = lm_loss(model(test::rows_for(tokens, rank, world)),
                                test::rows_for(targets, rank, world));
      loss.backward();
      EXPECT_TRUE(test::within_bound(test::world_mean(loss.item<double>()),
                                     ref_loss.item<double>(), test::loss_bound(ref_loss, world)))
          << "loss";
      auto bounds = test::expect_gradients_match(model, reference);
      test::step_and_expect_parameters_match(model, reference, opt, ref_opt, adam, bounds);
    }
  }
}

TEST(TorchModules, ShardModuleLaysOutASequentialOfLinears) {
  auto mesh = test::tp_mesh();
  test::TpMlp ref = test::make_tp_mlp(), source = test::make_tp_mlp();
  nn::Sequential model(source->fc1, torch::nn::ReLU(), source->fc2);
  ShardingPlan plan;
  plan.plan = {{"0.weight", {Shard(0)}}, {"0.bias", {Shard(0)}}, {"2.weight", {Shard(1)}}};
  plan.input_plan = {{"0.input", {Replicate()}}};
  plan.output_plan = {{"2.output", {Replicate()}}};
  shard_module(model, mesh, plan);
  // The wrapped Linear reads the DTensor its registry now holds.
  EXPECT_TRUE(source->fc1->weight.is_same(model->named_parameters()["0.weight"]));
  if (dist::get_world_size() > 1) {
    EXPECT_TRUE(is_dtensor(source->fc1->weight));
  }

  torch::manual_seed(100);
  const at::Tensor x = torch::randn({5, 6}), y = torch::randn({5, 6});
  const test::MlpBounds bounds = test::mlp_bounds(ref, x, y);
  // MSE by element-wise ops, which DTensors have rules for.
  auto mse = [](const at::Tensor& out, const at::Tensor& target) {
    at::Tensor diff = out - target;
    return (diff * diff).mean();
  };
  at::Tensor ref_out = ref(x);
  at::Tensor ref_loss = mse(ref_out, y);
  ref_loss.backward();
  at::Tensor out = model(x);
  EXPECT_TRUE(test::within_bound(test::whole(out), ref_out, bounds.out)) << "output";
  at::Tensor loss = mse(out, y);
  loss.backward();
  EXPECT_TRUE(test::within_bound(test::whole(loss).item<double>(), ref_loss.item<double>(),
                                 bounds.loss))
      << "loss";
  const std::map<std::string, std::string> ref_name{
      {"0.weight", "fc1.weight"}, {"0.bias", "fc1.bias"}, {"2.weight", "fc2.weight"},
      {"2.bias", "fc2.bias"}};
  auto ref_params = ref->named_parameters();
  for (const auto& item : model->named_parameters()) {
    SCOPED_TRACE(item.key());
    const std::string& name = ref_name.at(item.key());
    ASSERT_TRUE(item.value().grad().defined());
    EXPECT_TRUE(test::within_bound(test::whole(item.value().grad()), ref_params[name].grad(),
                                   bounds.grad.at(name)));
  }
}

// A unit whose forward takes the shards of a parameter of shape [4] if its
// hooks do not run.
struct ScaleImpl : nn::Module {
  ScaleImpl() : nn::Module("Scale") { weight = register_parameter("weight", torch::ones({4})); }
  at::Tensor forward(const at::Tensor& x) { return x * weight; }
  at::Tensor weight;
};
HP_MODULE(Scale);

TEST(TorchModules, UnitInsideTorchSequentialIsRefusedNamingIt) {
  struct NetImpl : torch::nn::Module {
    NetImpl() {
      layers = register_module("layers", torch::nn::Sequential(Scale(), Scale()));
    }
    at::Tensor forward(const at::Tensor& x) { return layers->forward(x); }
    torch::nn::Sequential layers{nullptr};
  };
  auto net = nn::hooked(std::make_shared<NetImpl>());
  for (size_t i = 0; i < net->wrapped()->layers->size(); ++i) {
    fully_shard(std::dynamic_pointer_cast<nn::Module>(net->wrapped()->layers->ptr(i)));
  }
  EXPECT_THAT([&] { fully_shard(net.ptr()); },
              testing::ThrowsMessage<ArgumentError>(
                  testing::AllOf(HasSubstr("'layers.0'"), HasSubstr("hp::nn::Sequential"))));
  EXPECT_FALSE(is_fully_sharded(*net));
}

TEST(TorchModules, UnitCalledWithoutHooksIsRefusedNamingIt) {
  // The head unit's forward is called directly: it would compute on a
  // shard of its weight.
  struct NetImpl : nn::Module {
    NetImpl() : nn::Module("Net") {
      body = register_module("body", torch::nn::Linear(4, 4));
      head = register_module("head", nn::Hooked<torch::nn::LinearImpl>(4, 4));
    }
    at::Tensor forward(const at::Tensor& x) { return head->forward(body(x)); }
    torch::nn::Linear body{nullptr};
    nn::Hooked<torch::nn::LinearImpl> head{nullptr};
  };
  auto net = std::make_shared<NetImpl>();
  fully_shard(net->head.ptr());
  fully_shard(std::static_pointer_cast<nn::Module>(net));
  EXPECT_THAT([&] { nn::call(*net, torch::ones({2, 4})); },
              testing::ThrowsMessage<ArgumentError>(
                  testing::AllOf(HasSubstr("head"), HasSubstr("through its holder"))));
  // A forward without grad is not checked (no graph); the check stays armed.
  {
    at::NoGradGuard no_grad;
    nn::call(*net, torch::ones({2, 4}));
  }
  EXPECT_THROW(nn::call(*net, torch::ones({2, 4})), ArgumentError);
}

TEST(TorchModules, ShardModuleRefusesAPlanInsideTorchSequential) {
  auto mesh = test::tp_mesh();
  struct NetImpl : nn::Module {
    NetImpl() : nn::Module("Net") {
      layers = register_module("layers", torch::nn::Sequential(Scale()));
    }
    at::Tensor forward(const at::Tensor& x) { return layers->forward(x); }
    torch::nn::Sequential layers{nullptr};
  };
  auto net = std::make_shared<NetImpl>();
  ShardingPlan plan;
  plan.input_plan = {{"layers.0.input", {Replicate()}}};
  EXPECT_THAT([&] { shard_module(net, mesh, plan); },
              testing::ThrowsMessage<ArgumentError>(
                  testing::AllOf(HasSubstr("'layers.0'"), HasSubstr("hp::nn::Sequential"))));
}

}  // namespace
}  // namespace hp
