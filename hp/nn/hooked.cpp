#include "hp/nn/hooked.h"

#include "hp/util/error.h"

namespace hp::nn {
namespace {

// Registers `from`'s parameters, buffers and submodules in `to` under the
// same names: the same tensors and modules, not copies. The parameter
// registry is a protected member, copied whole (entries of undefined tensors
// included, as Linear's "bias" without bias), through a pointer to it formed
// inside a derived class (as replace_parameter.cpp reads it); buffers and
// submodules, private, go through the public registration.
struct Registries : torch::nn::Module {
  static void share(torch::nn::Module& from, torch::nn::Module& to) {
    to.*(&Registries::parameters_) = from.*(&Registries::parameters_);
    for (const auto& item : from.named_buffers(/*recurse=*/false)) {
      to.register_buffer(item.key(), item.value());
    }
    for (const auto& item : from.named_children()) to.register_module(item.key(), item.value());
  }
};

std::string wrapper_name(torch::nn::Module* wrapped) {
  HP_CHECK_ARG(wrapped != nullptr, "hp::nn::hooked: the module to wrap is null");
  HP_CHECK_ARG(dynamic_cast<Module*>(wrapped) == nullptr, "hp::nn::hooked: module ",
               wrapped->name(), " is an hp::nn::Module, hookable already; expected a "
               "torch::nn module (call an hp::nn::Module through its holder)");
  return "hp::nn::Hooked<" + wrapped->name() + ">";
}

}  // namespace

HookedBase::HookedBase(torch::nn::Module* wrapped) : Module(wrapper_name(wrapped)) {
  // The same tensors and modules, not copies: a change through either
  // module (set_data, an optimizer step, fully_shard's swaps) is seen by both.
  Registries::share(*wrapped, *this);
  Module::train(wrapped->is_training());
}

void HookedBase::train(bool on) {
  Module::train(on);  // this flag and the shared submodules
  wrapped_module().train(on);
}

bool HookedBase::is_training() const noexcept { return wrapped_module().is_training(); }

// The wrapped module moves its parameters, buffers and submodules in place
// (set_data), which are also this module's.
void HookedBase::to(torch::Device device, torch::Dtype dtype, bool non_blocking) {
  wrapped_module().to(device, dtype, non_blocking);
}

void HookedBase::to(torch::Dtype dtype, bool non_blocking) {
  wrapped_module().to(dtype, non_blocking);
}

void HookedBase::to(torch::Device device, bool non_blocking) {
  wrapped_module().to(device, non_blocking);
}

void HookedBase::pretty_print(std::ostream& stream) const {
  stream << "hp::nn::Hooked<";
  wrapped_module().pretty_print(stream);
  stream << ">";
}

}  // namespace hp::nn
