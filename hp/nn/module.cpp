#include "hp/nn/module.h"

#include <algorithm>

namespace hp::nn {

struct Module::Hooks {
  int64_t next_id = 0;
  std::vector<std::pair<int64_t, ForwardPreHook>> pre;
  std::vector<std::pair<int64_t, ForwardHook>> post;
};

void HookHandle::remove() {
  if (remove_ && !owner_.expired()) remove_();
  remove_ = nullptr;
}

Module::Module(std::string name) : torch::nn::Module(std::move(name)), hooks_(std::make_shared<Hooks>()) {}

Module::~Module() = default;

HookHandle Module::register_forward_pre_hook(ForwardPreHook hook, bool prepend) {
  const int64_t id = hooks_->next_id++;
  auto entry = std::make_pair(id, std::move(hook));
  if (prepend) {
    hooks_->pre.insert(hooks_->pre.begin(), std::move(entry));
  } else {
    hooks_->pre.push_back(std::move(entry));
  }
  Hooks* hooks = hooks_.get();
  return HookHandle(hooks_, [hooks, id] {
    auto& v = hooks->pre;
    v.erase(std::remove_if(v.begin(), v.end(), [id](const auto& e) { return e.first == id; }),
            v.end());
  });
}

HookHandle Module::register_forward_hook(ForwardHook hook, bool prepend) {
  const int64_t id = hooks_->next_id++;
  auto entry = std::make_pair(id, std::move(hook));
  if (prepend) {
    hooks_->post.insert(hooks_->post.begin(), std::move(entry));
  } else {
    hooks_->post.push_back(std::move(entry));
  }
  Hooks* hooks = hooks_.get();
  return HookHandle(hooks_, [hooks, id] {
    auto& v = hooks->post;
    v.erase(std::remove_if(v.begin(), v.end(), [id](const auto& e) { return e.first == id; }),
            v.end());
  });
}

bool Module::has_forward_hooks() const { return !hooks_->pre.empty() || !hooks_->post.empty(); }

TensorList Module::run_hooked(TensorList inputs,
                              const std::function<TensorList(TensorList&)>& body) {
  // Copies: a hook may remove itself (or others) while running.
  auto pre = hooks_->pre;
  for (auto& [id, hook] : pre) {
    if (auto replaced = hook(*this, inputs)) inputs = std::move(*replaced);
  }
  TensorList outputs = body(inputs);
  auto post = hooks_->post;
  for (auto& [id, hook] : post) {
    if (auto replaced = hook(*this, inputs, outputs)) outputs = std::move(*replaced);
  }
  return outputs;
}

}  // namespace hp::nn
