// Any libtorch module as a hookable module (N1 in docs/features.md).
//
// fully_shard, shard_module and activation checkpointing intercept the calls
// of hp::nn::Modules (module.h); a model written with libtorch's own modules
// takes part by wrapping the modules that must be intercepted:
//
//   hp::nn::Hooked<torch::nn::LinearImpl> head(torch::nn::LinearOptions(64, 256));
//   auto layer = hp::nn::hooked(torch::nn::TransformerEncoderLayer(options));
//   auto model = hp::nn::hooked(MyNet(...));       // a user's torch::nn::Module
//   hp::fully_shard(layer.ptr());  hp::fully_shard(model.ptr());
//   at::Tensor y = model(x);                       // runs the hooks (not model->forward(x))
//
// HookedImpl<Impl> is an hp::nn::Module around a shared Impl (the wrapped
// module; it may still be used directly, without hooks, through its own
// holder). The wrapper is transparent:
//   names       its parameters, buffers and submodules are the wrapped
//               module's own tensors and modules under the same names (no
//               "module." prefix): named_parameters(), state_dicts and
//               checkpoints do not change with wrapping. They are shared as
//               registered when wrapping: register on the wrapped module
//               before wrapping it (LinearImpl::reset() after wrapping would
//               register new tensors the wrapper does not see).
//   forward     the holder's call runs the hooks around Impl::forward with
//               the same arguments; defaulted arguments may be left out
//               (TransformerEncoderLayer's masks), and an undefined tensor
//               stands for "none" as in module.h. Hooks need forward's
//               arguments to be tensors and its result a tensor, a tuple of
//               tensors or a vector of tensors (module.h).
//   state       train()/eval(), is_training(), to(device/dtype), zero_grad(),
//               pretty_print act on the wrapped module; replace_parameter
//               (replace_parameter.h) updates the wrapped module's registry
//               and member fields too (Linear's `weight`).
// Errors: wrapping a null module or an hp::nn::Module raises ArgumentError.
// Threads: as any module, not to be used from two threads at once.
#pragma once

#include <memory>
#include <ostream>
#include <string>
#include <type_traits>
#include <utility>

#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include "hp/nn/module.h"

namespace hp::nn {

// What every HookedImpl<Impl> is, whatever Impl: replace_parameter and the
// containers reach the wrapped module through it.
class HookedBase : public Module {
 public:
  // The wrapped module (never null).
  virtual torch::nn::Module& wrapped_module() const = 0;

  void train(bool on = true) override;
  bool is_training() const noexcept override;
  void to(torch::Device device, torch::Dtype dtype, bool non_blocking = false) override;
  void to(torch::Dtype dtype, bool non_blocking = false) override;
  void to(torch::Device device, bool non_blocking = false) override;
  void pretty_print(std::ostream& stream) const override;

 protected:
  // Registers `wrapped`'s parameters, buffers and submodules as this
  // module's own, under their names. ArgumentError if `wrapped` is null or
  // already hookable.
  explicit HookedBase(torch::nn::Module* wrapped);
};

template <typename Impl>
class HookedImpl : public HookedBase {
  static_assert(std::is_base_of_v<torch::nn::Module, Impl>,
                "hp::nn::Hooked wraps torch::nn::Module implementations (e.g. LinearImpl)");

 public:
  // Shares `module`.
  explicit HookedImpl(std::shared_ptr<Impl> module)
      : HookedBase(module.get()), wrapped_(std::move(module)) {}

  // Builds the wrapped module from Impl's constructor arguments.
  template <typename... Args,
            typename = std::enable_if_t<std::is_constructible_v<Impl, Args&&...> &&
                                        !(sizeof...(Args) == 1 &&
                                          (std::is_same_v<std::decay_t<Args>,
                                                          std::shared_ptr<Impl>> && ...))>>
  explicit HookedImpl(Args&&... args)
      : HookedImpl(std::make_shared<Impl>(std::forward<Args>(args)...)) {}

  // The wrapped module's forward, without hooks (the holder adds them).
  template <typename... Args>
  auto forward(Args&&... args)
      -> decltype(std::declval<Impl&>().forward(std::forward<Args>(args)...)) {
    return wrapped_->forward(std::forward<Args>(args)...);
  }

  const std::shared_ptr<Impl>& wrapped() const { return wrapped_; }
  torch::nn::Module& wrapped_module() const override { return *wrapped_; }

 private:
  std::shared_ptr<Impl> wrapped_;
};

// The holder: `Hooked<torch::nn::LinearImpl> fc(4, 8); fc(x)` runs the hooks.
template <typename Impl>
class Hooked : public ModuleHolder<HookedImpl<Impl>> {
 public:
  using ModuleHolder<HookedImpl<Impl>>::ModuleHolder;
};

// Wraps an existing module (a holder such as torch::nn::Linear, or its
// shared_ptr); the wrapper shares it.
template <typename Impl>
Hooked<Impl> hooked(std::shared_ptr<Impl> module) {
  static_assert(!std::is_base_of_v<Module, Impl>,
                "an hp::nn::Module is hookable already: call it through its holder");
  return Hooked<Impl>(std::make_shared<HookedImpl<Impl>>(std::move(module)));
}

template <typename Impl>
Hooked<Impl> hooked(const torch::nn::ModuleHolder<Impl>& module) {
  return hooked(module.ptr());
}

}  // namespace hp::nn
