#include "hp/fsdp/materialize.h"

#include <torch/torch.h>

#include <map>
#include <unordered_map>
#include <unordered_set>

#include "hp/fsdp/fsdp_param.h"
#include "hp/fsdp/registry.h"
#include "hp/fsdp/unit.h"
#include "hp/nn/meta_device.h"
#include "hp/nn/replace_parameter.h"
#include "hp/tensor/dtensor.h"
#include "hp/tensor/dtensor_tensor.h"
#include "hp/tensor/shard_spec.h"
#include "hp/util/error.h"

namespace hp {
namespace {

// The tensor data lives in: a DTensor parameter's local shard, else itself.
const at::Tensor& data_of(const at::Tensor& t) { return is_dtensor(t) ? local_of(t) : t; }

bool on_meta(const at::Tensor& t) {
  if (auto managed = fsdp::find_managed(t)) return managed->param->on_meta();
  return data_of(t).is_meta();
}

c10::Device default_device(const nn::Module& model) {
  auto units = fsdp::units_in_tree(model);
  if (!units.empty()) return units.front()->mesh().mesh->device();
  for (const auto& item : model.named_parameters(/*recurse=*/true)) {
    if (is_dtensor(item.value())) return layout_of(item.value()).mesh()->device();
  }
  return c10::Device(c10::DeviceType::CPU);
}

at::Tensor empty_like_on(const at::Tensor& t, c10::Device device) {
  at::Tensor fresh = at::empty(t.sizes(), t.options().device(device));
  if (t.requires_grad()) fresh.set_requires_grad(true);
  return fresh;
}

// Where a step writes: `local`, this rank's piece of a tensor of `shape`
// laid out by `layout` (undefined: the whole tensor).
struct Target {
  at::Tensor local;
  Layout layout;
  std::vector<int64_t> shape;
};

Target target_of(const at::Tensor& t) {
  if (auto managed = fsdp::find_managed(t)) {
    const fsdp::FSDPParam& p = *managed->param;
    return {p.local_shard(), p.shard_layout(), p.global_shape()};
  }
  if (is_dtensor(t)) return {local_of(t), layout_of(t), t.sizes().vec()};
  return {t, Layout(), t.sizes().vec()};
}

// This rank's piece of `whole` under `layout`: a view (no copy) when every
// placement is a plain Shard or Replicate, so a step's peak is the scratch
// tensor alone; a strided shard's piece of several blocks is a copy
// (distribute_tensor).
at::Tensor piece_of(const at::Tensor& whole, const Layout& layout) {
  const Layout norm = layout.normalized(whole.dim());
  for (const Placement& p : norm.placements()) {
    if (p.is_strided_shard() || p.is_partial()) return distribute_tensor(whole, norm).local();
  }
  const DeviceMesh& mesh = *norm.mesh();
  at::Tensor piece = whole;
  for (int64_t d = 0; d < whole.dim(); ++d) {
    const Span s = shard_span(whole.size(d), norm.spec(), d, mesh.shape(), mesh.coordinate());
    piece = piece.narrow(d, s.offset, s.size);
  }
  return piece;
}

}  // namespace

std::vector<std::string> to_empty(nn::Module& model, std::optional<c10::Device> device) {
  const c10::Device where = device.value_or(default_device(model));
  std::vector<std::string> names;
  for (const auto& item : model.named_parameters(/*recurse=*/true)) {
    if (on_meta(item.value())) names.push_back(item.key());
  }
  for (const auto& item : model.named_buffers(/*recurse=*/true)) {
    if (item.value().is_meta()) names.push_back(item.key());
  }

  // Managed parameters: each unit allocates its shards; a replaced plain
  // parameter is then re-registered under its name in the model.
  std::unordered_map<const c10::TensorImpl*, std::string> name_of;
  for (const auto& item : model.named_parameters(/*recurse=*/true)) {
    name_of.emplace(item.value().unsafeGetTensorImpl(), item.key());
  }
  for (const auto& unit : fsdp::units_in_tree(model)) {
    for (const auto& [old, fresh] : unit->materialize()) {
      auto it = name_of.find(old.unsafeGetTensorImpl());
      HP_CHECK_ARG(it != name_of.end(),
                   "to_empty: internal error: a managed parameter is not in the model");
      nn::replace_parameter(model, it->second, fresh);
      fsdp::unregister_param(old);
    }
  }
  // Parameters outside any unit: a DTensor's local shard on its mesh's
  // device (re-pointed in place), a plain one whole on `where`.
  at::NoGradGuard no_grad;
  for (const auto& item : model.named_parameters(/*recurse=*/true)) {
    at::Tensor param = item.value();
    if (fsdp::find_managed(param) || !data_of(param).is_meta()) continue;
    if (is_dtensor(param)) {
      const Layout& layout = layout_of(param);
      at::Tensor local = at::empty(local_of(param).sizes(),
                                   local_of(param).options().device(layout.mesh()->device()));
      param.set_data(wrap_local_shard(local, layout, param.sizes().vec()));
    } else {
      nn::replace_parameter(model, item.key(), empty_like_on(param, where));
    }
  }
  for (const auto& item : model.named_buffers(/*recurse=*/true)) {
    if (!item.value().is_meta()) continue;
    nn::replace_buffer(model, item.key(), empty_like_on(item.value(), where));
  }
  return names;
}

void init_sharded(nn::Module& model, const nn::InitPlan& plan, std::optional<c10::Device> device) {
  std::unordered_set<std::string> known, named;
  std::vector<std::string> uncovered;
  for (const auto& item : model.named_parameters(/*recurse=*/true)) known.insert(item.key());
  for (const auto& item : model.named_buffers(/*recurse=*/true)) known.insert(item.key());
  for (const nn::InitStep& step : plan) {
    HP_CHECK_ARG(known.count(step.name), "init_sharded: step '", step.name,
                 "' names no parameter or buffer of ", model.name());
    HP_CHECK_ARG(static_cast<bool>(step.fill), "init_sharded: step '", step.name,
                 "' has no fill function");
    named.insert(step.name);
  }
  for (const auto& item : model.named_parameters(/*recurse=*/true)) {
    if (on_meta(item.value()) && !named.count(item.key())) uncovered.push_back(item.key());
  }
  for (const auto& item : model.named_buffers(/*recurse=*/true)) {
    if (item.value().is_meta() && !named.count(item.key())) uncovered.push_back(item.key());
  }
  HP_CHECK_ARG(uncovered.empty(), "init_sharded: the plan has no step for ", to_string(uncovered),
               ", which are on the meta device and would stay uninitialised; expected a step "
               "per parameter and buffer on meta");

  to_empty(model, device);
  // Looked up after to_empty: replaced parameters are new tensors.
  std::map<std::string, at::Tensor> tensors;
  for (const auto& item : model.named_parameters(/*recurse=*/true)) {
    tensors[item.key()] = item.value();
  }
  for (const auto& item : model.named_buffers(/*recurse=*/true)) {
    tensors[item.key()] = item.value();
  }
  at::NoGradGuard no_grad;
  for (const nn::InitStep& step : plan) {
    const Target target = target_of(tensors.at(step.name));
    // One whole tensor at a time, on the CPU, from the default generator:
    // the eager model's draws.
    at::Tensor scratch = at::empty(target.shape, target.local.options().device(at::kCPU));
    step.fill(scratch);
    at::Tensor piece = target.layout.defined() ? piece_of(scratch, target.layout) : scratch;
    target.local.copy_(piece);
  }
}

}  // namespace hp
