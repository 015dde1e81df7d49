// Runs a torch::nn::Linear the way PyTorch's nn.Linear runs.
//
// libtorch's C++ Linear (torch::nn::functional::linear) multiplies with
// matmul and then adds the bias in a second kernel for any input that is not
// 2-D; PyTorch's nn.Linear calls aten::linear, which for a contiguous input
// with a bias folds the leading dims and runs one addmm, the bias added by
// the GEMM itself: one kernel and one pass less per layer, forward and
// backward. The models here call their Linear layers through this, so they
// compute what the same model in PyTorch computes, op for op.
//
// Not through the layer's forward: a hook installed on the layer itself
// (hp::nn::hooked) would not run. Our models do not hook their Linears.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/modules/linear.h>

namespace hp::nn {

at::Tensor linear(const torch::nn::Linear& layer, const at::Tensor& x);

}  // namespace hp::nn
