// Hookable modules (N1 in docs/features.md).
//
// libtorch modules have no forward hooks, and fully_shard and shard_module
// need them: a pre-hook all-gathers a unit's parameters (or redistributes
// its inputs), a post-hook reshards them and hooks the outputs' gradients.
// hp::nn::Module is a torch::nn::Module with two hook lists; a module built
// on it defines an ordinary `forward(...)` over tensors, and its holder
// (HP_MODULE(Name), in the spirit of TORCH_MODULE) makes `block(x)` run
//   pre-hooks (may replace the inputs) -> forward -> hooks (may replace the
//   outputs).
// Calling `block->forward(x)` directly bypasses the hooks, as in PyTorch.
// Plain torch::nn modules nest inside freely; only the modules whose calls
// must be intercepted need to be hp::nn modules, and any torch::nn module
// becomes one with hp::nn::hooked (hooked.h); hp::nn::Sequential and
// ModuleList (sequential.h, module_list.h) call their entries through hooks.
//
// A call that raises (in a pre-hook, in forward or in a hook) runs the
// module's error hooks before the exception propagates, innermost module
// first, so that state a pre-hook set up (fully_shard's gathered
// parameters) can be released: PyTorch's always_call forward hooks serve the
// same purpose.
//
// A forward wrapper, when set, runs in place of the plain call of forward,
// inside the hooks: activation checkpointing (hp/nn/activation_checkpoint.h)
// runs forward through an autograd function that recomputes it in backward.
//
// Hooks see the tensor arguments and outputs as flat lists; forward may take
// any number of at::Tensor arguments (an undefined tensor stands for "none")
// and return at::Tensor, std::tuple<at::Tensor...> or std::vector<at::Tensor>.
#pragma once

#include <cstdint>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

namespace hp::nn {

using TensorList = std::vector<at::Tensor>;

class Module;

// Returns replacement inputs, or nullopt to keep them.
using ForwardPreHook = std::function<std::optional<TensorList>(Module&, const TensorList& inputs)>;
// Returns replacement outputs, or nullopt to keep them.
using ForwardHook = std::function<std::optional<TensorList>(
    Module&, const TensorList& inputs, const TensorList& outputs)>;

// Runs when the module's call raised after its pre-hooks started; receives
// the exception, which propagates after every error hook ran. Must not
// throw (an exception from it is dropped: the first one is what the caller
// needs to see).
using ForwardErrorHook = std::function<void(Module&, const std::exception_ptr& error)>;

// The module's forward over its inputs as a list (no hooks).
using ForwardBody = std::function<TensorList(TensorList& inputs)>;
// Runs `body` on `inputs` for the module, in place of calling it directly.
// It may keep a copy of `body` (valid while the module lives) and call it
// again later, e.g. during backward.
using ForwardWrapper =
    std::function<TensorList(Module&, TensorList& inputs, const ForwardBody& body)>;

// Removes its hook when remove() is called (not on destruction, as PyTorch).
class HookHandle {
 public:
  HookHandle() = default;
  HookHandle(std::weak_ptr<void> owner, std::function<void()> remove)
      : owner_(std::move(owner)), remove_(std::move(remove)) {}
  void remove();

 private:
  std::weak_ptr<void> owner_;
  std::function<void()> remove_;
};

class Module : public torch::nn::Module {
 public:
  explicit Module(std::string name = "hp::nn::Module");
  ~Module() override;

  // prepend: run before the hooks already registered.
  HookHandle register_forward_pre_hook(ForwardPreHook hook, bool prepend = false);
  HookHandle register_forward_hook(ForwardHook hook, bool prepend = false);
  HookHandle register_forward_error_hook(ForwardErrorHook hook);
  // Hooks or a forward wrapper: a call must go through run_hooked.
  bool has_forward_hooks() const;

  // One wrapper per module; an empty one removes it.
  void set_forward_wrapper(ForwardWrapper wrapper) { wrapper_ = std::move(wrapper); }
  bool has_forward_wrapper() const { return static_cast<bool>(wrapper_); }

  // Runs the hooks around `body` (through the forward wrapper, if one is
  // set), and the error hooks if anything in it raises. Used by call();
  // rarely needed directly.
  TensorList run_hooked(TensorList inputs, const ForwardBody& body);

  // A typed slot other layers use to attach their per-module state (e.g.
  // fully_shard's unit), so that it lives and dies with the module.
  template <typename T>
  std::shared_ptr<T> attachment(const std::string& key) const {
    auto it = attachments_.find(key);
    return it == attachments_.end() ? nullptr : std::static_pointer_cast<T>(it->second);
  }
  void set_attachment(const std::string& key, std::shared_ptr<void> value) {
    attachments_[key] = std::move(value);
  }

 private:
  struct Hooks;
  std::shared_ptr<Hooks> hooks_;
  ForwardWrapper wrapper_;
  std::map<std::string, std::shared_ptr<void>> attachments_;
};

namespace detail {

template <typename T>
struct OutputTraits;

template <>
struct OutputTraits<at::Tensor> {
  static TensorList to_list(at::Tensor t) { return {std::move(t)}; }
  static at::Tensor from_list(TensorList l) { return std::move(l.at(0)); }
};

template <>
struct OutputTraits<TensorList> {
  static TensorList to_list(TensorList l) { return l; }
  static TensorList from_list(TensorList l) { return l; }
};

template <typename... Ts>
struct OutputTraits<std::tuple<Ts...>> {
  static TensorList to_list(std::tuple<Ts...> t) {
    return std::apply([](auto&&... xs) { return TensorList{at::Tensor(xs)...}; }, std::move(t));
  }
  static std::tuple<Ts...> from_list(TensorList l) {
    return from_list_impl(std::move(l), std::index_sequence_for<Ts...>{});
  }
  template <size_t... I>
  static std::tuple<Ts...> from_list_impl(TensorList l, std::index_sequence<I...>) {
    return std::tuple<Ts...>(std::move(l.at(I))...);
  }
};

template <typename Impl, size_t... I>
auto call_with_list(Impl& impl, TensorList& args, std::index_sequence<I...>) {
  return impl.forward(args[I]...);
}

}  // namespace detail

// Calls impl.forward(args...) with the module's hooks around it.
template <typename Impl, typename... Args>
auto call(Impl& impl, Args&&... args) {
  static_assert((std::is_convertible_v<std::decay_t<Args>, at::Tensor> && ...),
                "hooked forward arguments must be tensors");
  using Result = decltype(impl.forward(std::forward<Args>(args)...));
  if (!impl.has_forward_hooks()) return impl.forward(std::forward<Args>(args)...);
  TensorList inputs{at::Tensor(args)...};
  TensorList outputs = impl.run_hooked(std::move(inputs), [&impl](TensorList& in) {
    return detail::OutputTraits<Result>::to_list(
        detail::call_with_list(impl, in, std::index_sequence_for<Args...>{}));
  });
  return detail::OutputTraits<Result>::from_list(std::move(outputs));
}

// A holder whose operator() runs the hooks (torch::nn::ModuleHolder's would not).
template <typename Impl>
class ModuleHolder : public torch::nn::ModuleHolder<Impl> {
 public:
  using torch::nn::ModuleHolder<Impl>::ModuleHolder;
  template <typename... Args>
  auto operator()(Args&&... args) {
    return call(*this->get(), std::forward<Args>(args)...);
  }
};

}  // namespace hp::nn

// HP_MODULE(Block) declares `Block`, the holder of `BlockImpl`.
#define HP_MODULE(Name)                                             \
  class Name : public ::hp::nn::ModuleHolder<Name##Impl> {          \
   public:                                                          \
    using ::hp::nn::ModuleHolder<Name##Impl>::ModuleHolder;         \
    using Impl TORCH_UNUSED_EXCEPT_CUDA = Name##Impl;               \
  }
