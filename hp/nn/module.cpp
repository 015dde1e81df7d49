#include "hp/nn/module.h"

#include <algorithm>

namespace hp::nn {

struct Module::Hooks {
  int64_t next_id = 0;
  std::vector<std::pair<int64_t, ForwardPreHook>> pre;
  std::vector<std::pair<int64_t, ForwardHook>> post;
  std::vector<std::pair<int64_t, ForwardErrorHook>> error;

  // Adds `hook` to `self`'s `list` (pre or post) under a fresh id. The
  // handle refers to the hooks weakly: it may outlive the module.
  template <typename Hook>
  static HookHandle add(const std::shared_ptr<Hooks>& self,
                        std::vector<std::pair<int64_t, Hook>> Hooks::*list, Hook hook,
                        bool prepend) {
    const int64_t id = self->next_id++;
    auto& v = (*self).*list;
    auto entry = std::make_pair(id, std::move(hook));
    v.insert(prepend ? v.begin() : v.end(), std::move(entry));
    Hooks* raw = self.get();
    return HookHandle(self, [raw, list, id] {
      auto& hooks = (*raw).*list;
      hooks.erase(std::remove_if(hooks.begin(), hooks.end(),
                                 [id](const auto& e) { return e.first == id; }),
                  hooks.end());
    });
  }
};

void HookHandle::remove() {
  if (remove_ && !owner_.expired()) remove_();
  remove_ = nullptr;
}

Module::Module(std::string name) : torch::nn::Module(std::move(name)), hooks_(std::make_shared<Hooks>()) {}

Module::~Module() = default;

HookHandle Module::register_forward_pre_hook(ForwardPreHook hook, bool prepend) {
  return Hooks::add(hooks_, &Hooks::pre, std::move(hook), prepend);
}

HookHandle Module::register_forward_hook(ForwardHook hook, bool prepend) {
  return Hooks::add(hooks_, &Hooks::post, std::move(hook), prepend);
}

HookHandle Module::register_forward_error_hook(ForwardErrorHook hook) {
  return Hooks::add(hooks_, &Hooks::error, std::move(hook), /*prepend=*/false);
}

bool Module::has_forward_hooks() const {
  return !hooks_->pre.empty() || !hooks_->post.empty() || !hooks_->error.empty() ||
         static_cast<bool>(wrapper_);
}

TensorList Module::run_hooked(TensorList inputs, const ForwardBody& body) {
  // Copies: a hook may remove itself (or others) while running.
  auto pre = hooks_->pre;
  try {
    for (auto& [id, hook] : pre) {
      if (auto replaced = hook(*this, inputs)) inputs = std::move(*replaced);
    }
    // A copy: the wrapper may be replaced while it runs.
    TensorList outputs = wrapper_ ? ForwardWrapper(wrapper_)(*this, inputs, body) : body(inputs);
    auto post = hooks_->post;
    for (auto& [id, hook] : post) {
      if (auto replaced = hook(*this, inputs, outputs)) outputs = std::move(*replaced);
    }
    return outputs;
  } catch (...) {
    const std::exception_ptr error = std::current_exception();
    auto on_error = hooks_->error;
    for (auto& [id, hook] : on_error) {
      try {
        hook(*this, error);
      } catch (...) {
        // The caller needs the original exception; the hook's own failure
        // is the hook's to record.
      }
    }
    throw;
  }
}

}  // namespace hp::nn
