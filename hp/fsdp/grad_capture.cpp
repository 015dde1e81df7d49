#include "hp/fsdp/grad_capture.h"

#include <algorithm>
#include <exception>
#include <unordered_map>
#include <utility>

#include "hp/fsdp/unit.h"
#include "hp/util/error.h"

namespace hp::fsdp {

bool any_managed(const nn::TensorList& params) {
  return std::any_of(params.begin(), params.end(), [](const at::Tensor& p) {
    return p.defined() && find_managed(p).has_value();
  });
}

void check_capturable(const nn::TensorList& params, const std::string& caller) {
  for (size_t i = 0; i < params.size(); ++i) {
    HP_CHECK_ARG(params[i].defined() && params[i].is_leaf(), caller, ": weight ", i,
                 " is not a leaf tensor; with parameters of fully_shard units among the weights, "
                 "the gradients come from a backward that fills .grad, which only leaves have");
    auto managed = find_managed(params[i]);
    if (!managed) continue;
    const Unit& unit = *managed->unit;
    HP_CHECK_ARG(unit.flags().requires_gradient_sync, caller, ": unit ", unit.name(),
                 " (parameter '", managed->param->fqn(),
                 "') has gradient sync off (set_requires_gradient_sync(false)), so a backward "
                 "reduces none of its gradients, and ", caller,
                 " returns reduced gradients; turn gradient sync on for this call, or "
                 "accumulate unreduced micro-batches with backward()");
    HP_CHECK_ARG(!unit.mesh().has_replicas() || unit.flags().requires_all_reduce, caller,
                 ": unit ", unit.name(), " (parameter '", managed->param->fqn(),
                 "') has its all-reduce over replicas off (set_requires_all_reduce(false)), so "
                 "a backward reduces its gradients over the shard group only, and ", caller,
                 " returns fully reduced gradients; turn the all-reduce on for this call, or "
                 "accumulate partly reduced gradients with backward()");
  }
}

GradCapture::GradCapture(nn::TensorList params) : params_(std::move(params)) {
  for (const at::Tensor& param : params_) {
    const bool seen = std::any_of(held_.begin(), held_.end(), [&](const Held& h) {
      return h.param.unsafeGetTensorImpl() == param.unsafeGetTensorImpl();
    });
    if (seen) continue;
    Held held{param, find_managed(param), {}};
    if (held.managed) {
      held.grads = held.managed->param->take_held_grads();
    } else {
      held.grads.grad = std::exchange(param.mutable_grad(), at::Tensor());
    }
    held_.push_back(std::move(held));
  }
}

GradCapture::~GradCapture() { put_back(); }

nn::TensorList GradCapture::finish() {
  for (const Held& held : held_) {
    if (!held.managed) continue;
    const auto& context = held.managed->unit->context();
    if (!context || context->reductions().empty()) continue;
    try {
      context->reductions().complete_all();
    } catch (const CollectiveError&) {
      context->mark_unusable("the gradient reductions of parallelize_value_and_grad",
                             std::current_exception());
      throw;
    }
  }
  std::unordered_map<const c10::TensorImpl*, at::Tensor> delivered;
  for (Held& held : held_) {
    delivered[held.param.unsafeGetTensorImpl()] =
        held.managed ? held.managed->param->take_delivered_grad()
                     : std::exchange(held.param.mutable_grad(), at::Tensor());
  }
  put_back();
  nn::TensorList grads;
  grads.reserve(params_.size());
  for (const at::Tensor& param : params_) {
    grads.push_back(delivered.at(param.unsafeGetTensorImpl()));
  }
  return grads;
}

void GradCapture::put_back() noexcept {
  if (put_back_) return;
  put_back_ = true;
  for (Held& held : held_) {
    if (held.managed) {
      held.managed->param->restore_held_grads(std::move(held.grads));
    } else {
      held.param.mutable_grad() = std::move(held.grads.grad);
    }
  }
}

}  // namespace hp::fsdp
