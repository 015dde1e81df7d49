// AdamW whose step is one fused pass over each parameter (docs/features.md,
// O1).
//
// torch::optim::AdamW steps each parameter with about nine element-wise
// kernels (decay, two moment updates, square root, division, ...), each a
// pass over the parameter's memory. FusedAdamW is the same optimizer (same
// options, same per-parameter state, so checkpoints, hp::checkpoint's
// add_adamw and anything else written for AdamW take it unchanged) whose
// step() runs libtorch's fused AdamW kernel instead: one pass per
// parameter, on CPU and CUDA alike. The update is AdamW's; the values differ
// from torch::optim::AdamW's by rounding only (the kernel evaluates the same
// formula in another order, the first moment as a lerp).
//
// The fused kernel is used when every parameter with a gradient in a group
// is a dense contiguous floating tensor on one device with one dtype, its
// gradient and moments alike, and amsgrad is off. A tensor-form DTensor
// (hp/tensor/dtensor_tensor.h) qualifies when its gradient and moments are
// laid out as it is, without partial sums: the kernel then steps the local
// shards, as the elementwise update would through the DTensor rules.
// Otherwise, and on a libtorch without the kernel (before 2.4), step() is
// AdamW's own.
//
// Threads: as torch::optim::AdamW (one thread steps at a time).
#pragma once

#include <vector>

#include <torch/optim/adamw.h>

namespace hp::optim {

class FusedAdamW : public torch::optim::AdamW {
 public:
  FusedAdamW(const std::vector<at::Tensor>& params, torch::optim::AdamWOptions defaults);
  FusedAdamW(const std::vector<torch::optim::OptimizerParamGroup>& groups,
             torch::optim::AdamWOptions defaults);

  at::Tensor step(LossClosure closure = nullptr) override;

  // Whether this libtorch has the fused kernel (else step() is AdamW's).
  static bool available();
  // Whether the last step() ran the fused kernel on every group.
  bool last_step_fused() const { return last_step_fused_; }

 private:
  at::Tensor fall_back(LossClosure closure);
  bool last_step_fused_ = false;
};

}  // namespace hp::optim
