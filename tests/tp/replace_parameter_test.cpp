// replace_parameter (S1's mechanism): a registered parameter swapped for a
// tensor of another TensorImpl type, in the registry and the module
// fields, with ties kept and unknown module types refused. One process: the
// replacement is a sparse tensor, which set_data refuses as a tensor-form
// DTensor would be.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "hp/nn/module.h"
#include "hp/nn/replace_parameter.h"
#include "hp/util/error.h"

namespace hp {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::ThrowsMessage;

struct NetImpl : nn::Module {
  NetImpl() : nn::Module("Net") {
    fc = register_module("fc", torch::nn::Linear(3, 4));
    norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({4})));
    emb = register_module("emb", torch::nn::Embedding(5, 3));
  }
  torch::nn::Linear fc{nullptr};
  torch::nn::LayerNorm norm{nullptr};
  torch::nn::Embedding emb{nullptr};
};
HP_MODULE(Net);

// Holds its own parameter in a field replace_parameter cannot see.
struct OwnFieldImpl : torch::nn::Module {
  OwnFieldImpl() { w = register_parameter("w", torch::ones({2})); }
  at::Tensor w;
};
TORCH_MODULE(OwnField);

at::Tensor sparse_like(const at::Tensor& t) { return at::ones_like(t).detach().to_sparse(); }

TEST(ReplaceParameter, SetDataCannotDoIt) {
  torch::nn::Linear fc(3, 4);
  EXPECT_THROW(fc->weight.set_data(sparse_like(fc->weight)), c10::Error);
}

TEST(ReplaceParameter, UpdatesRegistryAndFields) {
  Net net;
  const at::Tensor bias = net->fc->bias;
  for (const char* name : {"fc.weight", "norm.weight", "norm.bias", "emb.weight"}) {
    SCOPED_TRACE(name);
    at::Tensor value = sparse_like(net->named_parameters()[name]);
    nn::replace_parameter(*net, name, value);
    EXPECT_TRUE(net->named_parameters()[name].is_same(value));
  }
  EXPECT_TRUE(net->fc->weight.is_sparse());
  EXPECT_TRUE(net->norm->weight.is_sparse());
  EXPECT_TRUE(net->norm->bias.is_sparse());
  EXPECT_TRUE(net->emb->weight.is_sparse());
  // Untouched parameters keep their identity.
  EXPECT_TRUE(net->fc->bias.is_same(bias));
  EXPECT_TRUE(net->named_parameters()["fc.bias"].is_same(bias));
  EXPECT_EQ(net->parameters().size(), 5u);
}

TEST(ReplaceParameter, TiedParametersStayTied) {
  Net net;
  // emb.weight registered a second time, as an output head tied to the
  // embedding would hold it.
  auto head = std::make_shared<torch::nn::Module>();
  head->register_parameter("weight", net->emb->weight);
  net->register_module("head", head);
  at::Tensor value = sparse_like(net->emb->weight);
  nn::replace_parameter(*net, "head.weight", value);
  EXPECT_TRUE(net->emb->weight.is_same(value));
  EXPECT_TRUE(net->named_parameters()["emb.weight"].is_same(value));
  EXPECT_TRUE(net->named_parameters()["head.weight"].is_same(value));
  EXPECT_EQ(net->named_parameters().size(), 6u);  // libtorch lists a tie under each name
}

TEST(ReplaceParameter, RefusesModulesWithUnknownFieldsBeforeChangingAnything) {
  auto root = std::make_shared<torch::nn::Module>();
  OwnField own;
  root->register_module("own", own);
  // A plain torch::nn::Module holding the same tensor can be updated, the
  // OwnField cannot: nothing may change.
  root->register_parameter("shared", own->w);
  EXPECT_THAT([&] { nn::replace_parameter(*root, "own.w", sparse_like(own->w)); },
              ThrowsMessage<ArgumentError>(AllOf(HasSubstr("parameter 'own.w'"),
                                                 HasSubstr("module 'own'"),
                                                 HasSubstr("register_parameter_fields"))));
  EXPECT_FALSE(root->named_parameters()["shared"].is_sparse());
  EXPECT_FALSE(own->named_parameters()["w"].is_sparse());

  nn::register_parameter_fields<OwnFieldImpl>(
      [](OwnFieldImpl& m, const std::string& name, const at::Tensor& value) {
        if (name == "w") m.w = value;
      });
  at::Tensor value = sparse_like(own->w);
  nn::replace_parameter(*root, "shared", value);
  EXPECT_TRUE(own->w.is_same(value));
  EXPECT_TRUE(root->named_parameters()["own.w"].is_same(value));
  EXPECT_TRUE(root->named_parameters()["shared"].is_same(value));
}

TEST(ReplaceParameter, Errors) {
  Net net;
  EXPECT_THAT([&] { nn::replace_parameter(*net, "fc.wieght", at::zeros({4, 3})); },
              ThrowsMessage<ArgumentError>(
                  AllOf(HasSubstr("'fc.wieght' is no parameter"), HasSubstr("fc.weight"))));
  EXPECT_THAT([&] { nn::replace_parameter(*net, "fc.weight", at::zeros({3, 4})); },
              ThrowsMessage<ArgumentError>(HasSubstr("has sizes [3, 4] but the parameter has [4, 3]")));
}

}  // namespace
}  // namespace hp
