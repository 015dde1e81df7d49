#include "hp/nn/activation_checkpoint.h"

#include <torch/torch.h>

#include <algorithm>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>

#include "hp/util/cuda_timer.h"
#include "hp/util/error.h"
#include "hp/util/gpu_trace.h"
#include "hp/util/trace.h"

namespace hp::nn {

namespace {

// Marks a module whose forward wrapper is ours (nn::Module::attachment).
constexpr const char* kCheckpointAttachment = "hp.nn.activation_checkpoint";

// The generators a recomputation must replay: the CPU one, and the CUDA one
// of every device an input is on.
class RngStates {
 public:
  static RngStates capture(const TensorList& inputs) {
    RngStates s;
    s.states_.emplace_back(at::kCPU, state_of(at::kCPU));
    for (const auto& t : inputs) {
      if (!t.defined() || !t.device().is_cuda()) continue;
      const at::Device device = t.device();
      bool seen = false;
      for (const auto& entry : s.states_) seen = seen || entry.first == device;
      if (!seen) s.states_.emplace_back(device, state_of(device));
    }
    return s;
  }

  // Sets every generator to its state here.
  void restore() const {
    for (const auto& [device, state] : states_) {
      at::Generator gen = at::globalContext().defaultGenerator(device);
      std::lock_guard<std::mutex> lock(gen.mutex());
      gen.set_state(state);
    }
  }

  // The same generators' current states.
  RngStates current() const {
    RngStates s;
    for (const auto& entry : states_) s.states_.emplace_back(entry.first, state_of(entry.first));
    return s;
  }

 private:
  static at::Tensor state_of(at::Device device) {
    at::Generator gen = at::globalContext().defaultGenerator(device);
    std::lock_guard<std::mutex> lock(gen.mutex());
    return gen.get_state();
  }

  std::vector<std::pair<at::Device, at::Tensor>> states_;
};

// Runs a recomputation from `saved` and puts the generators back as they
// were, also when the recomputation raises: the steps after it draw what
// they would have drawn without checkpointing.
class ReplayRng {
 public:
  explicit ReplayRng(const RngStates& saved) : before_(saved.current()) { saved.restore(); }
  ~ReplayRng() {
    try {
      before_.restore();
    } catch (...) {
      // set_state of a state get_state produced does not fail; a destructor
      // must not throw in any case.
    }
  }
  ReplayRng(const ReplayRng&) = delete;
  ReplayRng& operator=(const ReplayRng&) = delete;

 private:
  RngStates before_;
};

// Recomputations running on this thread (one inside another when a
// checkpointed module contains one).
thread_local int recomputing = 0;

struct Recomputing {
  Recomputing() { ++recomputing; }
  ~Recomputing() { --recomputing; }
  Recomputing(const Recomputing&) = delete;
  Recomputing& operator=(const Recomputing&) = delete;
};

// What backward needs besides the saved inputs.
struct Recompute : torch::CustomClassHolder {
  Recompute(ForwardBody body, RngStates rng, std::string name)
      : body(std::move(body)), rng(std::move(rng)), name(std::move(name)) {}
  ForwardBody body;
  // The module whose forward `body` calls, kept alive until backward.
  std::shared_ptr<torch::nn::Module> owner;
  RngStates rng;
  std::string name;  // for the trace
  // Inputs the caller passed (the rest of the saved list is a placeholder
  // that makes the outputs require grad, see checkpointed_call).
  size_t real_inputs = 0;
};

struct CheckpointFunction : torch::autograd::Function<CheckpointFunction> {
  // Autograd runs this without grad mode: nothing inside body is recorded.
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                at::TensorList inputs,
                                                c10::intrusive_ptr<Recompute> recompute) {
    ctx->save_for_backward(inputs.vec());
    // Unused output gradients stay undefined instead of becoming zeros.
    ctx->set_materialize_grads(false);
    TensorList args(inputs.begin(), inputs.begin() + recompute->real_inputs);
    TensorList outputs = recompute->body(args);
    ctx->saved_data["recompute"] = c10::IValue::make_capsule(std::move(recompute));
    return outputs;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs) {
    auto recompute =
        c10::static_intrusive_pointer_cast<Recompute>(ctx->saved_data.at("recompute").toCapsule());
    const torch::autograd::variable_list saved = ctx->get_saved_variables();
    // Leaves of the recomputed graph: backward through it stops at them and
    // leaves their gradients in .grad.
    TensorList leaves;
    for (size_t i = 0; i < recompute->real_inputs; ++i) {
      const at::Tensor& t = saved[i];
      leaves.push_back(t.defined() ? t.detach().requires_grad_(t.requires_grad()) : t);
    }
    const int64_t start = trace::enabled() ? trace::now_us() : 0;
    // On a GPU the trace also marks the stream the recomputation runs on
    // (autograd runs this on the forward's stream): when the device ran it.
    trace::GpuMarkPtr gpu_start;
    std::optional<c10::Device> cuda;
    if (trace::enabled()) {
      for (const at::Tensor& t : saved) {
        if (t.defined() && t.is_cuda()) {
          cuda = t.device();
          break;
        }
      }
      if (cuda) gpu_start = cuda_trace_mark(*cuda);
    }
    TensorList outputs;
    {
      ReplayRng replay(recompute->rng);
      Recomputing recomputing_now;
      at::AutoGradMode grad_mode(true);
      TensorList args = leaves;
      outputs = recompute->body(args);
    }
    HP_CHECK_ARG(outputs.size() == grad_outputs.size(),
                 "activation checkpointing: the recomputed forward of ", recompute->name,
                 " returned ", outputs.size(), " outputs, but the forward returned ",
                 grad_outputs.size());
    TensorList roots, grads;
    for (size_t i = 0; i < outputs.size(); ++i) {
      if (outputs[i].defined() && outputs[i].requires_grad() && grad_outputs[i].defined()) {
        roots.push_back(outputs[i]);
        grads.push_back(grad_outputs[i]);
      }
    }
    outputs.clear();  // the recomputed graph is held by `roots` alone
    if (!roots.empty()) torch::autograd::backward(roots, grads);
    if (trace::enabled()) {
      std::string name = "recompute+backward " + recompute->name;
      trace::record(name, "compute", "compute", start, trace::now_us());
      if (gpu_start) {
        trace::record_gpu(std::move(name), "compute", "compute", std::move(gpu_start),
                          cuda_trace_mark(*cuda));
      }
    }
    torch::autograd::variable_list result;
    for (const auto& leaf : leaves) {
      result.push_back(leaf.defined() && leaf.requires_grad() ? leaf.grad() : at::Tensor());
    }
    // The placeholder and the non-tensor argument get none.
    result.resize(saved.size() + 1);
    return result;
  }
};

TensorList checkpointed_call(const ForwardBody& body, const TensorList& inputs, std::string name,
                             std::shared_ptr<torch::nn::Module> owner) {
  if (!at::GradMode::is_enabled()) {
    TensorList args = inputs;
    return body(args);
  }
  auto recompute =
      c10::make_intrusive<Recompute>(body, RngStates::capture(inputs), std::move(name));
  recompute->real_inputs = inputs.size();
  recompute->owner = std::move(owner);
  TensorList all = inputs;
  const bool any_requires_grad = std::any_of(inputs.begin(), inputs.end(), [](const at::Tensor& t) {
    return t.defined() && t.requires_grad();
  });
  // Autograd makes the outputs require grad only when an input does; the
  // body's parameters may need gradients all the same, so an empty
  // placeholder that requires grad stands in (as PyTorch's checkpoint does).
  if (!any_requires_grad) all.push_back(at::empty({0}).requires_grad_(true));
  return CheckpointFunction::apply(at::TensorList(all), std::move(recompute));
}

}  // namespace

TensorList checkpointed(const ForwardBody& body, const TensorList& inputs) {
  return checkpointed_call(body, inputs, "checkpointed function", nullptr);
}

void set_activation_checkpointing(Module& module, bool enabled) {
  const bool ours = is_activation_checkpointed(module);
  if (!enabled) {
    if (ours) {
      module.set_forward_wrapper(nullptr);
      module.set_attachment(kCheckpointAttachment, nullptr);
    }
    return;
  }
  if (ours) return;
  HP_CHECK_ARG(!module.has_forward_wrapper(), "set_activation_checkpointing: module ",
               module.name(), " already has another forward wrapper");
  module.set_forward_wrapper([](Module& m, TensorList& inputs, const ForwardBody& body) {
    return checkpointed_call(body, inputs, m.name(), m.weak_from_this().lock());
  });
  module.set_attachment(kCheckpointAttachment, std::make_shared<bool>(true));
}

bool in_recomputation() { return recomputing > 0; }

bool is_activation_checkpointed(const Module& module) {
  return module.attachment<bool>(kCheckpointAttachment) != nullptr;
}

}  // namespace hp::nn
