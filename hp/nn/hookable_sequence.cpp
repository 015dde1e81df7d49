#include "hp/nn/hookable_sequence.h"

#include "hp/util/error.h"

namespace hp::nn {

namespace detail {

void throw_wrong_entry(const char* container, size_t index, const Module& entry,
                       const std::string& expected) {
  throw_argument_error(cat(container, "::get: entry ", index, " is a ", entry.name(),
                           ", not a ", expected));
}

}  // namespace detail

const std::shared_ptr<Module>& HookableSequence::ptr(size_t index) const {
  HP_CHECK_ARG(index < modules_.size(), container_, ": index ", index, " is out of range for ",
               modules_.size(), " modules");
  return modules_[index];
}

at::Tensor HookableSequence::call_one(size_t index, const at::Tensor& input) {
  const OneTensorCall& one = one_tensor_calls_.at(index);
  HP_CHECK_ARG(one != nullptr, container_, ": module ", index, " (", modules_[index]->name(),
               ") cannot be called with one tensor returning one tensor; call it through "
               "get<Impl>(", index, ") instead");
  return one(input);
}

void HookableSequence::append(std::shared_ptr<Module> module, OneTensorCall one) {
  HP_CHECK_ARG(module != nullptr, container_, ": module ", modules_.size(), " is null");
  register_module(std::to_string(modules_.size()), module);
  modules_.push_back(std::move(module));
  one_tensor_calls_.push_back(std::move(one));
}

}  // namespace hp::nn
