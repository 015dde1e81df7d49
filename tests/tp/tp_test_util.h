// Helpers the tensor-parallel tests share.
#pragma once

#include <ATen/ATen.h>
#include <torch/torch.h>

#include <cmath>

#include "hp/distributed/world.h"
#include "hp/fsdp/fsdp_param.h"
#include "hp/fsdp/registry.h"
#include "hp/mesh/device_mesh.h"
#include "hp/nn/gpt.h"
#include "hp/tensor/dtensor_tensor.h"
#include "tests/support/model_configs.h"

namespace hp::test {

// A 1-D mesh "tp" over every rank.
inline DeviceMeshPtr tp_mesh() {
  return init_device_mesh("cpu", {dist::get_world_size()}, {"tp"});
}

// A model with parameters drawn from a fixed seed and unit-scale noise added
// (as the PyTorch parity test does: at GPT-2's tiny initial weights every
// layer is nearly linear and a wrong rule hardly shows).
inline nn::GPT noisy_gpt(const nn::GPTConfig& config, at::ScalarType dtype) {
  torch::manual_seed(1234);
  nn::GPT model(config);
  model->to(dtype);
  auto gen = at::detail::createCPUGenerator(77);
  torch::NoGradGuard no_grad;
  for (auto& p : model->parameters()) {
    const double scale = p.dim() == 2 ? 1.0 / std::sqrt(double(p.size(1))) : 0.1;
    p.add_(torch::randn(p.sizes(), gen).to(dtype) * scale);
  }
  return model;
}

// The whole value of a parameter, gradient or output (gathered if a DTensor).
inline at::Tensor whole(const at::Tensor& t) {
  at::NoGradGuard no_grad;
  return is_dtensor(t) ? full_tensor(t) : t.detach();
}

// Copies `source`'s parameters (whole, the same on every rank) into
// `target`'s: each rank its piece of a DTensor, of a fully_shard shard (by
// its unit's layout), or the whole of a plain one.
inline void load_into(nn::GPT& target, nn::GPT& source) {
  torch::NoGradGuard no_grad;
  auto from = source->named_parameters();
  for (auto& p : target->named_parameters()) {
    const at::Tensor& full = from[p.key()];
    auto managed = fsdp::find_managed(p.value());
    if (is_dtensor(p.value())) {
      local_of(p.value()).copy_(local_of(distribute(full, layout_of(p.value()))));
    } else if (managed) {
      p.value().copy_(distribute_tensor(full, managed->param->shard_layout()).local());
    } else {
      p.value().copy_(full);
    }
  }
}

}  // namespace hp::test
