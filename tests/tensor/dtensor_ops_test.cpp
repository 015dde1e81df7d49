// smoke
#include <ATen/ATen.h>
#include <torch/torch.h>
#include <gtest/gtest.h>

#include "hp/dist/world.h"
#include "hp/tensor/dtensor_tensor.h"

namespace hp {
namespace {

TEST(DTensorOps, Smoke) {
  auto mesh = init_device_mesh("cpu", {dist::get_world_size()}, {"tp"});
  torch::manual_seed(0);
  auto opts = torch::TensorOptions().dtype(torch::kDouble);
  at::Tensor x = torch::randn({4, 6}, opts);
  at::Tensor w1 = torch::randn({10, 6}, opts), b1 = torch::randn({10}, opts);
  at::Tensor w2 = torch::randn({6, 10}, opts), b2 = torch::randn({6}, opts);
  at::Tensor W1 = distribute(w1.clone().requires_grad_(), Layout(mesh, {Shard(0)}));
  at::Tensor B1 = distribute(b1.clone().requires_grad_(), Layout(mesh, {Shard(0)}));
  at::Tensor W2 = distribute(w2.clone().requires_grad_(), Layout(mesh, {Shard(1)}));
  at::Tensor B2 = distribute(b2.clone().requires_grad_(), Layout(mesh, {Replicate()}));
  at::Tensor X = distribute(x, Layout(mesh, {Replicate()}));
  at::Tensor h = torch::gelu(torch::nn::functional::linear(X, W1, B1));
  std::cerr << "h " << layout_of(h).str() << "\n";
  at::Tensor y = torch::nn::functional::linear(h, W2, B2);
  std::cerr << "y " << layout_of(y).str() << "\n";
  at::Tensor loss = y.pow(2).sum();
  std::cerr << "loss " << layout_of(loss).str() << "\n";
  loss.backward();
  std::cerr << "W1.grad " << layout_of(W1.grad()).str() << "\n";

  at::Tensor rw1 = w1.clone().requires_grad_(), rb1 = b1.clone().requires_grad_();
  at::Tensor rw2 = w2.clone().requires_grad_(), rb2 = b2.clone().requires_grad_();
  at::Tensor ry = torch::nn::functional::linear(torch::gelu(torch::nn::functional::linear(x, rw1, rb1)), rw2, rb2);
  ry.pow(2).sum().backward();
  std::cerr << "y diff " << (full_tensor(y) - ry).abs().max().item<double>() << "\n";
  std::cerr << "loss " << loss.item<double>() << " vs " << ry.pow(2).sum().item<double>() << "\n";
  for (auto [a, b] : std::vector<std::pair<at::Tensor, at::Tensor>>{{W1, rw1}, {B1, rb1}, {W2, rw2}, {B2, rb2}}) {
    std::cerr << layout_of(a.grad()).str() << " grad diff " << (full_tensor(a.grad()) - b.grad()).abs().max().item<double>() << "\n";
  }
  torch::optim::AdamW opt({W1, B1, W2, B2}, torch::optim::AdamWOptions(1e-2));
  opt.step();
  torch::optim::AdamW ropt({rw1, rb1, rw2, rb2}, torch::optim::AdamWOptions(1e-2));
  ropt.step();
  std::cerr << "after step W1 diff " << (full_tensor(W1) - rw1).abs().max().item<double>() << "\n";
  double n = torch::nn::utils::clip_grad_norm_(std::vector<at::Tensor>{W1, B1, W2, B2}, 1.0);
  double rn = torch::nn::utils::clip_grad_norm_(std::vector<at::Tensor>{rw1, rb1, rw2, rb2}, 1.0);
  std::cerr << "norm " << n << " vs " << rn << "\n";
}

}  // namespace
}  // namespace hp
