#include "hp/nn/rms_norm.h"

#include <torch/torch.h>

#include <mutex>

#include "hp/nn/replace_parameter.h"
#include "hp/util/error.h"

namespace hp::nn {

RMSNormImpl::RMSNormImpl(int64_t dim, double eps) : Module("RMSNorm"), dim_(dim), eps_(eps) {
  HP_CHECK_ARG(dim > 0, "RMSNorm: dim ", dim, " must be positive");
  HP_CHECK_ARG(eps > 0, "RMSNorm: eps ", eps, " must be positive");
  weight = register_parameter("weight", torch::ones({dim}));
  // forward reads the `weight` field: tell replace_parameter (shard_module)
  // to update it with the registry.
  static std::once_flag fields_registered;
  std::call_once(fields_registered, [] {
    register_parameter_fields<RMSNormImpl>(
        [](RMSNormImpl& norm, const std::string& name, const at::Tensor& value) {
          if (name == "weight") norm.weight = value;
        });
  });
}

at::Tensor RMSNormImpl::forward(const at::Tensor& x) {
  HP_CHECK_ARG(x.dim() >= 1 && x.size(-1) == dim_, "RMSNorm.forward: x of shape ", x.sizes(),
               " must end in ", dim_);
  const at::ScalarType dtype = x.scalar_type();
  const bool low = dtype == at::kHalf || dtype == at::kBFloat16;
  at::Tensor h = low ? x.to(at::kFloat) : x;
  // pow(2) rather than h * h (the same value): one input, so a Partial
  // DTensor is reduced once, not once per operand.
  at::Tensor variance = h.pow(2).mean(-1, /*keepdim=*/true);
  h = h * torch::rsqrt(variance + eps_);
  return weight * (low ? h.to(dtype) : h);
}

}  // namespace hp::nn
