#include "hp/nn/rotary.h"

#include <torch/torch.h>

#include "hp/util/error.h"

namespace hp::nn {

std::pair<at::Tensor, at::Tensor> rotary_tables(int64_t T, int64_t head_dim, double theta,
                                                const c10::TensorOptions& options) {
  HP_CHECK_ARG(T >= 1, "rotary_tables: T ", T, " must be at least 1");
  HP_CHECK_ARG(head_dim > 0 && head_dim % 2 == 0, "rotary_tables: head_dim ", head_dim,
               " must be positive and even");
  HP_CHECK_ARG(theta > 1, "rotary_tables: theta ", theta, " must be greater than 1");
  const auto f64 = torch::TensorOptions().dtype(torch::kDouble);
  at::Tensor inv_freq =
      1.0 / torch::pow(theta, torch::arange(0, head_dim, 2, f64) / double(head_dim));
  at::Tensor angles = torch::outer(torch::arange(T, f64), inv_freq);  // [T, head_dim / 2]
  at::Tensor both = torch::cat({angles, angles}, /*dim=*/-1);         // [T, head_dim]
  return {both.cos().to(options), both.sin().to(options)};
}

at::Tensor apply_rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t half = x.size(-1) / 2;
  at::Tensor rotated = torch::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, /*dim=*/-1);
  return x * cos + rotated * sin;
}

}  // namespace hp::nn
