// The storage that hp::nn::Sequential and hp::nn::ModuleList share (N1 in
// docs/features.md): an ordered list of hookable modules registered as
// submodules "0", "1", ... as in torch::nn::Sequential and ModuleList, so a
// model written with libtorch's containers keeps its parameter names.
//
// push_back takes a holder (torch::nn::Linear, an HP_MODULE holder,
// hp::nn::Hooked<...>) or a shared_ptr to a module. An hp::nn::Module is
// stored as it is; any other torch::nn module is wrapped in
// hp::nn::HookedImpl (hooked.h), which shares it and keeps its names. Every
// entry is therefore an hp::nn::Module that fully_shard, shard_module and
// activation checkpointing accept: `for (auto& m : *seq) hp::fully_shard(m);`.
//
// get<Impl>(i) returns a holder whose call runs entry i's hooks:
//   layers->get<torch::nn::TransformerEncoderLayerImpl>(i)(x, mask)
//   layers->get<MyBlockImpl>(i)(x)      (an hp::nn::Module)
// ArgumentError for an index out of range or an entry of another type.
// Threads: as any module.
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <c10/util/Type.h>

#include "hp/nn/hooked.h"
#include "hp/nn/module.h"

namespace hp::nn {
namespace detail {

template <typename Impl, typename = void>
struct TakesOneTensor : std::false_type {};
template <typename Impl>
struct TakesOneTensor<Impl, std::void_t<decltype(std::declval<Impl&>().forward(
                                std::declval<at::Tensor&>()))>>
    : std::is_same<std::decay_t<decltype(std::declval<Impl&>().forward(
                       std::declval<at::Tensor&>()))>,
                   at::Tensor> {};

[[noreturn]] void throw_wrong_entry(const char* container, size_t index, const Module& entry,
                                    const std::string& expected);

}  // namespace detail

class HookableSequence : public Module {
 public:
  using Iterator = std::vector<std::shared_ptr<Module>>::const_iterator;

  template <typename M>
  void push_back(M&& module) {
    using Decayed = std::decay_t<M>;
    if constexpr (std::is_base_of_v<torch::detail::ModuleHolderIndicator, Decayed>) {
      add(module.ptr());
    } else {
      add(std::forward<M>(module));
    }
  }

  size_t size() const { return modules_.size(); }
  bool is_empty() const { return modules_.empty(); }
  Iterator begin() const { return modules_.begin(); }
  Iterator end() const { return modules_.end(); }
  // Entry `index` (ArgumentError if out of range).
  const std::shared_ptr<Module>& ptr(size_t index) const;
  const std::shared_ptr<Module>& operator[](size_t index) const { return ptr(index); }

  // A holder of entry `index`, whose call runs its hooks (see above).
  template <typename Impl>
  auto get(size_t index) const {
    if constexpr (std::is_base_of_v<Module, Impl>) {
      auto impl = std::dynamic_pointer_cast<Impl>(ptr(index));
      if (!impl) {
        detail::throw_wrong_entry(container_, index, *ptr(index), c10::demangle_type<Impl>());
      }
      return ModuleHolder<Impl>(std::move(impl));
    } else {
      auto impl = std::dynamic_pointer_cast<HookedImpl<Impl>>(ptr(index));
      if (!impl || !impl->wrapped()) {
        detail::throw_wrong_entry(container_, index, *ptr(index),
                                  std::string("hp::nn::Hooked<") +
                                      c10::demangle_type<Impl>() + ">");
      }
      return Hooked<Impl>(std::move(impl));
    }
  }

 protected:
  explicit HookableSequence(const char* container) : Module(container), container_(container) {}

  // Calls entry `index` with one tensor through its hooks; ArgumentError if
  // its forward does not take one tensor and return one.
  at::Tensor call_one(size_t index, const at::Tensor& input);

 private:
  using OneTensorCall = std::function<at::Tensor(const at::Tensor&)>;

  template <typename Impl>
  void add(std::shared_ptr<Impl> module) {
    static_assert(std::is_base_of_v<torch::nn::Module, Impl>, "expected a torch::nn module");
    if constexpr (std::is_base_of_v<Module, Impl>) {
      OneTensorCall one;
      if constexpr (detail::TakesOneTensor<Impl>::value) {
        Impl* raw = module.get();  // owned by this container as long as the call
        one = [raw](const at::Tensor& x) { return call(*raw, x); };
      }
      append(std::move(module), std::move(one));
    } else {
      add(std::make_shared<HookedImpl<Impl>>(std::move(module)));
    }
  }

  void append(std::shared_ptr<Module> module, OneTensorCall one);

  const char* container_;
  std::vector<std::shared_ptr<Module>> modules_;
  std::vector<OneTensorCall> one_tensor_calls_;
};

}  // namespace hp::nn
