// Element-wise ops: the output takes the shard of any input that is sharded
// on a non-broadcast dim, and the other inputs follow it (a Replicate input
// is sliced locally, no communication). Partial survives only where the op
// is linear in it (see PartialRule).
#include "hp/tensor/dispatch/rule_util.h"

namespace hp::dispatch {

namespace {

Rule pointwise(PartialRule partial) {
  return [partial](OpCall& call) {
    int64_t inplace = -1;
    const auto& args = call.op().schema().arguments();
    for (size_t k = 0; k < call.inputs().size(); ++k) {
      const auto* alias = args[call.inputs()[k].arg].alias_info();
      if (alias && alias->isWrite()) inplace = static_cast<int64_t>(k);
    }
    return plan_pointwise(call, partial, inplace);
  };
}

}  // namespace

void register_pointwise_rules() {
  for (const char* op : {"aten::add.Tensor", "aten::add_.Tensor", "aten::sub.Tensor",
                         "aten::sub_.Tensor", "aten::copy_"}) {
    register_rule(op, pointwise(PartialRule::kLinear), true);
  }
  for (const char* op : {"aten::mul.Tensor", "aten::mul_.Tensor", "aten::div.Tensor",
                         "aten::div_.Tensor"}) {
    register_rule(op, pointwise(PartialRule::kMultiplicative), true);
  }
  for (const char* op :
       {"aten::neg", "aten::neg_", "aten::mul.Scalar", "aten::mul_.Scalar", "aten::div.Scalar",
        "aten::div_.Scalar", "aten::clone", "aten::_to_copy", "aten::detach", "aten::detach_",
        "aten::alias", "aten::lift_fresh", "aten::zero_", "aten::positive"}) {
    register_rule(op, pointwise(PartialRule::kPreserving), true);
  }
  for (const char* op :
       {"aten::gelu", "aten::gelu_", "aten::gelu_backward", "aten::relu", "aten::relu_",
        "aten::threshold_backward", "aten::tanh", "aten::tanh_backward", "aten::sigmoid",
        "aten::sigmoid_backward", "aten::exp", "aten::exp_", "aten::log", "aten::sqrt",
        "aten::sqrt_", "aten::rsqrt", "aten::pow.Tensor_Scalar", "aten::pow.Tensor_Tensor",
        "aten::pow_.Scalar", "aten::abs", "aten::abs_", "aten::sign", "aten::sgn",
        "aten::clamp", "aten::clamp_", "aten::clamp_min", "aten::clamp_min_",
        "aten::clamp_max", "aten::clamp_max_", "aten::masked_fill.Scalar",
        "aten::masked_fill_.Scalar", "aten::where.self", "aten::addcdiv", "aten::addcdiv_",
        "aten::addcmul", "aten::addcmul_", "aten::lerp_.Scalar", "aten::lerp.Scalar",
        "aten::maximum", "aten::minimum", "aten::eq.Tensor", "aten::eq.Scalar",
        "aten::ne.Tensor", "aten::ne.Scalar", "aten::lt.Tensor", "aten::lt.Scalar",
        "aten::gt.Tensor", "aten::gt.Scalar", "aten::le.Tensor", "aten::le.Scalar",
        "aten::ge.Tensor", "aten::ge.Scalar", "aten::add.Scalar", "aten::add_.Scalar",
        "aten::sub.Scalar", "aten::rsub.Scalar", "aten::rsub.Tensor", "aten::reciprocal",
        "aten::reciprocal_", "aten::fill_.Scalar", "aten::fill_.Tensor", "aten::bernoulli_.float",
        "aten::erf", "aten::logical_not", "aten::isnan", "aten::isinf", "aten::nan_to_num",
        "aten::sin", "aten::cos", "aten::silu", "aten::silu_backward",
        "aten::square", "aten::_masked_scale", "aten::native_dropout_backward",
        "aten::logical_and", "aten::logical_or", "aten::bitwise_and.Tensor",
        "aten::bitwise_or.Tensor"}) {
    register_rule(op, pointwise(PartialRule::kNone), true);
  }
}

}  // namespace hp::dispatch
