#include "hp/optim/fused_adamw.h"

#include <torch/torch.h>

#include <map>
#include <memory>
#include <utility>

#include "hp/tensor/dtensor_tensor.h"
#include "hp/util/torch_compat.h"

#if HP_TORCH_AT_LEAST(2, 4)
#include <ATen/ops/_fused_adamw.h>
#define HP_HAS_FUSED_ADAMW 1
#else
#define HP_HAS_FUSED_ADAMW 0
#endif

namespace hp::optim {

using torch::optim::AdamWOptions;
using torch::optim::AdamWParamState;
using StateMap = ska::flat_hash_map<void*, std::unique_ptr<torch::optim::OptimizerParamState>>;

FusedAdamW::FusedAdamW(const std::vector<at::Tensor>& params, AdamWOptions defaults)
    : torch::optim::AdamW(params, std::move(defaults)) {}

FusedAdamW::FusedAdamW(const std::vector<torch::optim::OptimizerParamGroup>& groups,
                       AdamWOptions defaults)
    : torch::optim::AdamW(groups, std::move(defaults)) {}

bool FusedAdamW::available() { return HP_HAS_FUSED_ADAMW != 0; }

#if HP_HAS_FUSED_ADAMW

namespace {

// The tensor the kernel steps for `t`, a parameter `p`'s gradient or moment
// (or `p` itself): `t`, or for a tensor-form DTensor its local shard,
// provided it is laid out as `p` and holds no partial sums: the update is
// elementwise, so stepping the shards steps the whole. Undefined where `t`
// does not qualify (then AdamW's own step, through the DTensor rules, runs).
at::Tensor kernel_operand(const at::Tensor& t, const at::Tensor& p) {
  if (!is_dtensor(p)) return is_dtensor(t) ? at::Tensor() : t;
  if (!is_dtensor(t)) return at::Tensor();
  const Layout& layout = layout_of(t);
  if (layout != layout_of(p) || layout.without_partial() != layout) return at::Tensor();
  return local_of(t);
}

bool fusable(const at::Tensor& t, const at::TensorOptions& first) {
  return t.defined() && t.layout() == at::kStrided && t.is_contiguous() &&
         at::isFloatingType(t.scalar_type()) && t.device() == first.device() &&
         t.scalar_type() == first.dtype().toScalarType();
}

AdamWParamState& state_for(StateMap& state, const at::Tensor& p) {
  auto& slot = state[p.unsafeGetTensorImpl()];
  if (!slot) {  // as AdamW creates it (DTensor-shaped for a DTensor)
    auto fresh = std::make_unique<AdamWParamState>();
    fresh->step(0);
    fresh->exp_avg(at::zeros_like(p, at::MemoryFormat::Preserve));
    fresh->exp_avg_sq(at::zeros_like(p, at::MemoryFormat::Preserve));
    slot = std::move(fresh);
  }
  return static_cast<AdamWParamState&>(*slot);
}

}  // namespace

at::Tensor FusedAdamW::step(LossClosure closure) {
  // Each group's operands as the kernel takes them. Should one tensor not
  // qualify, AdamW's own step runs for every group instead (a state this
  // loop created is AdamW's fresh state, so it finds nothing different).
  struct Batch {
    std::vector<at::Tensor> params, grads, exp_avgs, exp_avg_sqs;
    std::vector<AdamWParamState*> states;
    const AdamWOptions* options = nullptr;
  };
  std::vector<Batch> batches;
  for (auto& group : param_groups_) {
    const auto& options = static_cast<const AdamWOptions&>(group.options());
    if (options.amsgrad()) return fall_back(std::move(closure));
    Batch batch;
    batch.options = &options;
    for (const auto& p : group.params()) {
      if (!p.grad().defined()) continue;
      AdamWParamState& s = state_for(state_, p);
      at::Tensor local = kernel_operand(p, p);
      if (!local.defined()) return fall_back(std::move(closure));
      const at::TensorOptions first =
          batch.params.empty() ? local.options() : batch.params.front().options();
      at::Tensor ops[] = {local, kernel_operand(p.grad(), p), kernel_operand(s.exp_avg(), p),
                          kernel_operand(s.exp_avg_sq(), p)};
      for (const at::Tensor& t : ops) {
        if (!fusable(t, first)) return fall_back(std::move(closure));
      }
      batch.params.push_back(ops[0]);
      batch.grads.push_back(ops[1]);
      batch.exp_avgs.push_back(ops[2]);
      batch.exp_avg_sqs.push_back(ops[3]);
      batch.states.push_back(&s);
    }
    batches.push_back(std::move(batch));
  }

  at::NoGradGuard no_grad;
  at::Tensor loss;
  if (closure) {
    at::AutoGradMode enable_grad(true);
    loss = closure();
  }
  for (Batch& batch : batches) {
    if (batch.params.empty()) continue;
    // The kernel reads each parameter's step count, after this step's
    // increment, from a float tensor on its device, as PyTorch's fused
    // AdamW keeps it; one per distinct count (normally one).
    std::map<int64_t, at::Tensor> counts;
    std::vector<at::Tensor> steps;
    for (size_t i = 0; i < batch.params.size(); ++i) {
      AdamWParamState& s = *batch.states[i];
      s.step(s.step() + 1);
      at::Tensor& count = counts[s.step()];
      if (!count.defined()) {
        count = at::full({}, static_cast<double>(s.step()),
                         batch.params[i].options().dtype(at::kFloat));
      }
      steps.push_back(count);
    }
    const AdamWOptions& o = *batch.options;
    at::_fused_adamw_(batch.params, batch.grads, batch.exp_avgs, batch.exp_avg_sqs,
                      /*max_exp_avg_sqs=*/{}, steps, o.lr(), std::get<0>(o.betas()),
                      std::get<1>(o.betas()), o.weight_decay(), o.eps(), /*amsgrad=*/false,
                      /*maximize=*/false);
  }
  last_step_fused_ = true;
  return loss;
}

#else  // no fused kernel in this libtorch

at::Tensor FusedAdamW::step(LossClosure closure) { return fall_back(std::move(closure)); }

#endif

at::Tensor FusedAdamW::fall_back(LossClosure closure) {
  last_step_fused_ = false;
  return torch::optim::AdamW::step(std::move(closure));
}

}  // namespace hp::optim
