// Hookable modules (N1): hooks run around forward through the holder,
// can replace inputs and outputs, can be removed, and plain torch::nn
// modules nest inside.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "hp/nn/module.h"
#include "tests/support/tensor_checks.h"

namespace hp::nn {
namespace {

struct ScaleImpl : Module {
  explicit ScaleImpl(double factor) : Module("Scale"), factor(factor) {
    inner = register_module("inner", torch::nn::Linear(torch::nn::LinearOptions(3, 3).bias(false)));
    torch::NoGradGuard no_grad;
    inner->weight.copy_(torch::eye(3));
  }
  at::Tensor forward(const at::Tensor& x) { return inner(x) * factor; }
  double factor;
  torch::nn::Linear inner{nullptr};
};
HP_MODULE(Scale);

struct PairImpl : Module {
  std::tuple<at::Tensor, at::Tensor> forward(const at::Tensor& a, const at::Tensor& b) {
    return {a + b, a - b};
  }
};
HP_MODULE(Pair);

TEST(HookableModule, HooksRunAroundForwardInOrder) {
  Scale m(2.0);
  std::vector<std::string> events;
  m->register_forward_pre_hook([&](Module&, const TensorList& in) -> std::optional<TensorList> {
    events.push_back("pre");
    return TensorList{in[0] + 1};  // replace the input
  });
  m->register_forward_pre_hook(
      [&](Module&, const TensorList&) -> std::optional<TensorList> {
        events.push_back("pre-first");
        return std::nullopt;
      },
      /*prepend=*/true);
  auto handle = m->register_forward_hook(
      [&](Module&, const TensorList& in, const TensorList& out) -> std::optional<TensorList> {
        events.push_back("post");
        EXPECT_TRUE(test::tensors_equal(in[0], torch::full({1, 3}, 2.0f)));
        return TensorList{out[0] * 10};  // replace the output
      });
  at::Tensor y = m(torch::ones({1, 3}));
  EXPECT_EQ(events, (std::vector<std::string>{"pre-first", "pre", "post"}));
  EXPECT_TRUE(test::tensors_equal(y, torch::full({1, 3}, 40.0f)));
  // forward() itself bypasses hooks, as in PyTorch.
  EXPECT_TRUE(test::tensors_equal(m->forward(torch::ones({1, 3})), torch::full({1, 3}, 2.0f)));
  handle.remove();
  handle.remove();  // idempotent
  EXPECT_TRUE(test::tensors_equal(m(torch::ones({1, 3})), torch::full({1, 3}, 4.0f)));
}

TEST(HookableModule, TupleOutputsAndGradientsFlow) {
  Pair p;
  p->register_forward_hook([](Module&, const TensorList&, const TensorList& out)
                               -> std::optional<TensorList> { return TensorList{out[1], out[0]}; });
  at::Tensor a = torch::ones({2}, torch::requires_grad());
  at::Tensor b = torch::full({2}, 3.0);
  auto [first, second] = p(a, b);
  EXPECT_TRUE(test::tensors_equal(first, torch::full({2}, -2.0)));
  EXPECT_TRUE(test::tensors_equal(second, torch::full({2}, 4.0)));
  (first * 3).sum().backward();
  EXPECT_TRUE(test::tensors_equal(a.grad(), torch::full({2}, 3.0)));
}

// Raises in forward when given a negative input.
struct PickyImpl : Module {
  PickyImpl() : Module("Picky") {}
  at::Tensor forward(const at::Tensor& x) {
    if (x.min().item<double>() < 0) throw std::runtime_error("negative input");
    return x;
  }
};
HP_MODULE(Picky);

TEST(HookableModule, ErrorHooksRunWhenTheCallRaisesThenTheExceptionPropagates) {
  Picky inner;
  std::vector<std::string> events;
  inner->register_forward_pre_hook([&](Module&, const TensorList&) -> std::optional<TensorList> {
    events.push_back("pre");
    return std::nullopt;
  });
  inner->register_forward_hook(
      [&](Module&, const TensorList&, const TensorList&) -> std::optional<TensorList> {
        events.push_back("post");
        return std::nullopt;
      });
  inner->register_forward_error_hook([&](Module& m, const std::exception_ptr& error) {
    try {
      std::rethrow_exception(error);
    } catch (const std::runtime_error& e) {
      events.push_back(m.name() + " error: " + e.what());
    }
    throw std::logic_error("a failing error hook must not hide the cause");
  });
  inner->register_forward_error_hook(
      [&](Module&, const std::exception_ptr&) { events.push_back("second error hook"); });

  inner(torch::ones({2}));  // success: no error hook
  EXPECT_EQ(events, (std::vector<std::string>{"pre", "post"}));
  events.clear();
  EXPECT_THROW(
      {
        try {
          inner(-torch::ones({2}));
        } catch (const std::runtime_error& e) {
          EXPECT_STREQ(e.what(), "negative input");
          throw;
        }
      },
      std::runtime_error);
  EXPECT_EQ(events, (std::vector<std::string>{"pre", "Picky error: negative input",
                                              "second error hook"}));
}

TEST(HookableModule, ErrorHooksRunForAPreHookThatRaises) {
  Scale m(1.0);
  int errors = 0;
  m->register_forward_pre_hook([](Module&, const TensorList&) -> std::optional<TensorList> {
    throw std::runtime_error("pre-hook failed");
  });
  m->register_forward_error_hook([&](Module&, const std::exception_ptr&) { ++errors; });
  EXPECT_THROW(m(torch::ones({1, 3})), std::runtime_error);
  EXPECT_EQ(errors, 1);
}

TEST(HookableModule, ParametersOfNestedTorchModules) {
  Scale m(1.0);
  auto named = m->named_parameters();
  ASSERT_EQ(named.size(), 1u);
  EXPECT_EQ(named.keys()[0], "inner.weight");
}

}  // namespace
}  // namespace hp::nn
