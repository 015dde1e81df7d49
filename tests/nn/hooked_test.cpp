// Any libtorch module as a hookable module (N1): hp::nn::Hooked keeps the
// wrapped module's names, forward and state; hp::nn::Sequential and
// ModuleList call their entries through hooks with torch::nn's names.
#include <gtest/gtest.h>
#include <gmock/gmock.h>
#include <torch/torch.h>

#include "hp/nn/activation_checkpoint.h"
#include "hp/nn/hooked.h"
#include "hp/nn/module_list.h"
#include "hp/nn/replace_parameter.h"
#include "hp/nn/sequential.h"
#include "hp/util/error.h"
#include "tests/support/tensor_checks.h"

namespace hp::nn {
namespace {

using testing::HasSubstr;

std::vector<std::string> keys(const torch::OrderedDict<std::string, at::Tensor>& dict) {
  std::vector<std::string> out;
  for (const auto& item : dict) out.push_back(item.key());
  return out;
}

// The pre-hooks and hooks that ran on `m`, counted.
struct Counts {
  int pre = 0, post = 0;
};
std::shared_ptr<Counts> count_hooks(Module& m) {
  auto counts = std::make_shared<Counts>();
  m.register_forward_pre_hook([counts](Module&, const TensorList&) -> std::optional<TensorList> {
    ++counts->pre;
    return std::nullopt;
  });
  m.register_forward_hook(
      [counts](Module&, const TensorList&, const TensorList&) -> std::optional<TensorList> {
        ++counts->post;
        return std::nullopt;
      });
  return counts;
}

torch::nn::TransformerEncoderLayerOptions layer_options() {
  return torch::nn::TransformerEncoderLayerOptions(8, 2).dim_feedforward(16).dropout(0.0);
}

TEST(Hooked, NamesAreTheWrappedModulesOwn) {
  torch::nn::TransformerEncoderLayer plain(layer_options());
  auto wrapped = hooked(plain);
  EXPECT_EQ(keys(wrapped->named_parameters()), keys(plain->named_parameters()));
  // The same tensors, not copies.
  auto mine = wrapped->named_parameters();
  for (const auto& item : plain->named_parameters()) {
    EXPECT_TRUE(mine[item.key()].is_same(item.value())) << item.key();
  }
  torch::nn::BatchNorm1d norm(4);
  auto wrapped_norm = hooked(norm);
  EXPECT_EQ(keys(wrapped_norm->named_buffers()), keys(norm->named_buffers()));
  EXPECT_FALSE(keys(norm->named_buffers()).empty());
  // Built from the wrapped module's constructor arguments.
  Hooked<torch::nn::LinearImpl> fc(torch::nn::LinearOptions(4, 3).bias(false));
  EXPECT_EQ(keys(fc->named_parameters()), (std::vector<std::string>{"weight"}));
  EXPECT_TRUE(fc->named_parameters()["weight"].is_same(fc->wrapped()->weight));
}

TEST(Hooked, HolderCallRunsHooksAroundTheWrappedForward) {
  torch::manual_seed(0);
  torch::nn::TransformerEncoderLayer plain(layer_options());
  auto layer = hooked(plain);
  auto counts = count_hooks(*layer);
  const at::Tensor x = torch::randn({5, 3, 8});
  // Defaulted arguments may be left out; given ones reach the forward.
  EXPECT_TRUE(test::tensors_equal(layer(x), plain->forward(x)));
  const at::Tensor mask = torch::zeros({5, 5}).masked_fill(torch::ones({5, 5}).triu(1) > 0,
                                                           -std::numeric_limits<float>::infinity());
  EXPECT_TRUE(test::tensors_equal(layer(x, mask), plain->forward(x, mask)));
  EXPECT_FALSE(test::tensors_equal(layer(x, mask), layer(x)));
  EXPECT_EQ(counts->pre, 4);
  EXPECT_EQ(counts->post, 4);
  // forward() bypasses the hooks, as for any hp::nn::Module.
  layer->forward(x);
  EXPECT_EQ(counts->pre, 4);
  // A pre-hook's replacement input is what the wrapped forward sees.
  Hooked<torch::nn::LinearImpl> fc(3, 2);
  fc->register_forward_pre_hook([](Module&, const TensorList& in) -> std::optional<TensorList> {
    return TensorList{in[0] * 2};
  });
  const at::Tensor v = torch::randn({4, 3});
  EXPECT_TRUE(test::tensors_equal(fc(v), fc->wrapped()->forward(v * 2)));
}

TEST(Hooked, ReplaceParameterUpdatesTheWrappedModulesFields) {
  Hooked<torch::nn::LinearImpl> fc(3, 2);
  const at::Tensor value = torch::ones({2, 3}).requires_grad_();
  replace_parameter(*fc, "weight", value);
  EXPECT_TRUE(fc->wrapped()->weight.is_same(value));
  EXPECT_TRUE(fc->wrapped()->named_parameters()["weight"].is_same(value));
  EXPECT_TRUE(fc->named_parameters()["weight"].is_same(value));
  // Inside a container, by the container's names.
  torch::nn::Linear plain(3, 2);
  Sequential seq(torch::nn::ReLU(), plain);
  replace_parameter(*seq, "1.bias", torch::zeros({2}));
  EXPECT_TRUE(seq->named_parameters()["1.bias"].is_same(plain->bias));
  EXPECT_TRUE(plain->named_parameters()["bias"].is_same(plain->bias));
  EXPECT_TRUE(test::tensors_equal(plain->bias, torch::zeros({2})));
}

TEST(Hooked, TrainEvalToAndZeroGradReachTheWrappedModule) {
  torch::nn::Dropout dropout(0.5);
  auto wrapped = hooked(dropout);
  wrapped->eval();
  EXPECT_FALSE(dropout->is_training());
  EXPECT_FALSE(wrapped->is_training());
  const at::Tensor x = torch::ones({100});
  EXPECT_TRUE(test::tensors_equal(wrapped(x), x));
  wrapped->train();
  EXPECT_TRUE(dropout->is_training());

  torch::nn::Linear plain(3, 2);
  auto fc = hooked(plain);
  const c10::TensorImpl* impl = plain->weight.unsafeGetTensorImpl();
  fc->to(torch::kDouble);
  EXPECT_EQ(plain->weight.scalar_type(), torch::kDouble);
  EXPECT_EQ(plain->weight.unsafeGetTensorImpl(), impl);
  EXPECT_EQ(fc->named_parameters()["weight"].scalar_type(), torch::kDouble);
  fc(torch::ones({1, 3}, torch::kDouble)).sum().backward();
  EXPECT_TRUE(plain->weight.grad().defined());
  fc->zero_grad();
  EXPECT_FALSE(plain->weight.grad().defined() && plain->weight.grad().any().item<bool>());
  EXPECT_EQ(fc->parameters().size(), 2u);
}

TEST(Hooked, RefusesNullModules) {
  EXPECT_THROW(hooked(std::shared_ptr<torch::nn::LinearImpl>()), ArgumentError);
}

TEST(HookableSequential, NamesAndResultsAreTorchSequentials) {
  torch::manual_seed(0);
  torch::nn::Linear a(4, 6), b(6, 3);
  torch::nn::ReLU relu;
  torch::nn::Sequential plain(a, relu, b);
  Sequential seq(a, relu, b);
  EXPECT_EQ(keys(seq->named_parameters()), keys(plain->named_parameters()));
  const at::Tensor x = torch::randn({5, 4});
  EXPECT_TRUE(test::tensors_equal(seq(x), plain->forward(x)));
  EXPECT_EQ(seq->size(), 3u);
  for (const auto& entry : *seq) EXPECT_NE(entry, nullptr);
}

struct AddOneImpl : Module {
  AddOneImpl() : Module("AddOne") {}
  at::Tensor forward(const at::Tensor& x) { return x + 1; }
};
HP_MODULE(AddOne);

TEST(HookableSequential, CallsEveryEntryThroughItsHooks) {
  Sequential seq(torch::nn::Linear(2, 2), AddOne(), torch::nn::Tanh());
  std::vector<std::shared_ptr<Counts>> counts;
  for (const auto& entry : *seq) counts.push_back(count_hooks(*entry));
  seq(torch::ones({1, 2}));
  for (const auto& c : counts) {
    EXPECT_EQ(c->pre, 1);
    EXPECT_EQ(c->post, 1);
  }
  // An hp::nn::Module is stored as it is, a plain one wrapped.
  EXPECT_NE(std::dynamic_pointer_cast<AddOneImpl>(seq[1]), nullptr);
  EXPECT_NE(std::dynamic_pointer_cast<HookedImpl<torch::nn::LinearImpl>>(seq[0]), nullptr);
  // Activation checkpointing accepts an entry (its forward wrapper runs).
  set_activation_checkpointing(*seq[0]);
  EXPECT_TRUE(is_activation_checkpointed(*seq[0]));
}

TEST(HookableSequential, RefusesWhatItCannotChain) {
  Sequential empty;
  EXPECT_THROW(empty(torch::ones({1})), ArgumentError);
  Sequential seq(torch::nn::MultiheadAttention(4, 2));
  EXPECT_THAT([&] { seq(torch::ones({2, 1, 4})); },
              testing::ThrowsMessage<ArgumentError>(HasSubstr("module 0")));
}

TEST(HookableModuleList, GetReturnsAHolderThatRunsHooks) {
  torch::manual_seed(0);
  ModuleList layers{torch::nn::TransformerEncoderLayer{layer_options()}, AddOne{}};
  torch::nn::ModuleList plain{torch::nn::TransformerEncoderLayer{layer_options()}};
  EXPECT_EQ(keys(layers->named_parameters()), keys(plain->named_parameters()));
  auto counts = count_hooks(*layers[0]);
  const at::Tensor x = torch::randn({5, 3, 8});
  auto layer = layers->get<torch::nn::TransformerEncoderLayerImpl>(0);
  EXPECT_TRUE(test::tensors_equal(layer(x, at::Tensor(), at::Tensor()), layer->forward(x)));
  EXPECT_EQ(counts->pre, 1);
  EXPECT_TRUE(test::tensors_equal(layers->get<AddOneImpl>(1)(x), x + 1));
  EXPECT_THAT([&] { layers->get<torch::nn::LinearImpl>(0); },
              testing::ThrowsMessage<ArgumentError>(HasSubstr("entry 0")));
  EXPECT_THROW(layers->ptr(2), ArgumentError);
}

}  // namespace
}  // namespace hp::nn
