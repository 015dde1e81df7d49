#include "hp/nn/meta_device.h"

#include <torch/torch.h>

#include <unordered_map>
#include <vector>

#include "hp/nn/replace_parameter.h"
#include "hp/util/error.h"

namespace hp::nn {
namespace {

// torch::nn::Module keeps its buffers in the private `buffers_` and offers
// no way to replace one (register_buffer refuses a name in use). An
// explicit template instantiation may name a private member (access is not
// checked there), and the friend function it defines hands the member
// pointer out: the standard way to reach it without undefined behaviour.
using BufferDict = torch::OrderedDict<std::string, at::Tensor>;
using BufferMember = BufferDict torch::nn::Module::*;
BufferMember buffers_member();
template <BufferMember Member>
struct BufferMemberOf {
  friend BufferMember buffers_member() { return Member; }
};
template struct BufferMemberOf<&torch::nn::Module::buffers_>;

struct BufferAccess {
  static BufferDict& of(torch::nn::Module& module) { return module.*buffers_member(); }
};

at::Tensor meta_like(const at::Tensor& t) {
  at::Tensor meta = at::empty(t.sizes(), t.options().device(at::kMeta));
  if (t.requires_grad()) meta.set_requires_grad(true);
  return meta;
}

}  // namespace

void replace_buffer(torch::nn::Module& root, const std::string& name, const at::Tensor& value) {
  auto buffers = root.named_buffers(/*recurse=*/true);
  const at::Tensor* old = buffers.find(name);
  HP_CHECK_ARG(old != nullptr, "replace_buffer: '", name, "' is no buffer of ", root.name());
  HP_CHECK_ARG(value.defined() && value.sizes() == old->sizes(), "replace_buffer: the value for '",
               name, "' must have sizes ", old->sizes());
  const c10::TensorImpl* target = old->unsafeGetTensorImpl();
  root.apply([&](torch::nn::Module& module) {
    for (auto& item : BufferAccess::of(module)) {
      if (item.value().unsafeGetTensorImpl() == target) item.value() = value;
    }
  });
}

void move_to_meta(torch::nn::Module& module) {
  // One meta tensor per distinct tensor, so tied tensors stay tied.
  std::unordered_map<const c10::TensorImpl*, at::Tensor> done;
  for (const auto& item : module.named_parameters(/*recurse=*/true)) {
    const at::Tensor& p = item.value();
    if (p.is_meta() || done.count(p.unsafeGetTensorImpl())) continue;
    at::Tensor meta = meta_like(p);
    done.emplace(p.unsafeGetTensorImpl(), meta);
    replace_parameter(module, item.key(), meta);
  }
  for (const auto& item : module.named_buffers(/*recurse=*/true)) {
    const at::Tensor& b = item.value();
    if (b.is_meta() || done.count(b.unsafeGetTensorImpl())) continue;
    at::Tensor meta = meta_like(b);
    done.emplace(b.unsafeGetTensorImpl(), meta);
    replace_buffer(module, item.key(), meta);
  }
}

}  // namespace hp::nn
