#include "hp/fsdp/state_dict.h"

#include <torch/torch.h>

#include <algorithm>
#include <map>
#include <set>

#include "hp/dist/world.h"
#include "hp/fsdp/fully_shard.h"
#include "hp/fsdp/registry.h"
#include "hp/fsdp/unit.h"
#include "hp/util/error.h"

namespace hp {
namespace {

using fsdp::FSDPParam;

// The DTensor of a managed parameter's local shard.
DTensor shard_dtensor(const fsdp::ManagedParam& managed) {
  const FSDPParam& p = *managed.param;
  const fsdp::MeshInfo& mesh = managed.unit->mesh();
  Placements placements =
      p.sharded() ? mesh.placements(p.shard_dim()) : mesh.replicated_placements();
  return from_local(p.local_shard(), Layout(mesh.mesh, placements), {p.full_shape()});
}

// Every managed unit in the tree resharded, so parameters hold their shards.
void reshard_tree(const nn::Module& model) {
  auto* self = const_cast<nn::Module*>(&model);
  for (const auto& sub : self->modules(/*include_self=*/true)) {
    auto hookable = std::dynamic_pointer_cast<nn::Module>(sub);
    if (!hookable) continue;
    if (auto unit = hookable->attachment<fsdp::Unit>(fsdp::kUnitAttachment)) unit->reshard();
  }
}

std::string shape_text(at::IntArrayRef shape) { return to_string(shape.vec()); }

// Python-style tuple text, as the seeds' messages print shapes: "(2, 3)".
std::string tuple_text(at::IntArrayRef shape) {
  std::string out = "(";
  for (size_t i = 0; i < shape.size(); ++i) {
    out += cat(i ? ", " : "", shape[i]);
  }
  return out + (shape.size() == 1 ? ",)" : ")");
}

}  // namespace

StateDict get_model_state_dict(const nn::Module& model, const StateDictOptions& options) {
  reshard_tree(model);
  const bool keep = !options.rank0_only || !dist::is_initialized() || dist::get_rank() == 0;
  StateDict out;
  for (const auto& item : model.named_parameters(/*recurse=*/true)) {
    auto managed = fsdp::find_managed(item.value());
    if (!managed) {
      if (keep) out.emplace_back(item.key(), item.value().detach());
      continue;
    }
    DTensor local = shard_dtensor(*managed);
    if (!options.full_state_dict) {
      out.emplace_back(item.key(), local);
      continue;
    }
    at::Tensor whole = local.full_tensor();  // collective: every rank gathers
    if (keep) out.emplace_back(item.key(), whole);
  }
  for (const auto& item : model.named_buffers(/*recurse=*/true)) {
    if (keep) out.emplace_back(item.key(), item.value().detach());
  }
  return out;
}

void FSDPModule::load_state_dict(const StateDict& state_dict, bool strict) {
  nn::Module& model = *module_;
  std::map<std::string, at::Tensor> targets;
  for (const auto& item : model.named_parameters(/*recurse=*/true)) targets[item.key()] = item.value();
  for (const auto& item : model.named_buffers(/*recurse=*/true)) targets[item.key()] = item.value();
  if (strict) {
    std::set<std::string> given;
    for (const auto& entry : state_dict) given.insert(entry.first);
    std::vector<std::string> missing, unexpected;
    for (const auto& entry : targets) {
      if (!given.count(entry.first)) missing.push_back(entry.first);
    }
    for (const auto& key : given) {
      if (!targets.count(key)) unexpected.push_back(key);
    }
    if (!missing.empty() || !unexpected.empty()) {
      auto quoted = [](const std::vector<std::string>& keys) {
        std::string s;
        for (size_t i = 0; i < keys.size(); ++i) s += cat(i ? ", " : "", "'", keys[i], "'");
        return s;
      };
      std::string message = cat("Error(s) in loading state_dict for ", model.name(), ":");
      if (!missing.empty()) message += "\n\tMissing key(s): " + quoted(missing);
      if (!unexpected.empty()) message += "\n\tUnexpected key(s): " + quoted(unexpected);
      throw_argument_error(message);
    }
  }
  reshard_tree(model);
  at::NoGradGuard no_grad;
  for (const auto& [key, value] : state_dict) {
    auto it = targets.find(key);
    if (it == targets.end()) continue;
    const at::Tensor& target = it->second;
    auto managed = fsdp::find_managed(target);
    if (!managed) {
      at::Tensor source = std::holds_alternative<DTensor>(value)
                              ? std::get<DTensor>(value).full_tensor()
                              : std::get<at::Tensor>(value);
      HP_CHECK_ARG(source.sizes() == target.sizes(), "load '", key, "': tensor shape ",
                   tuple_text(source.sizes()), " does not match the parameter's shape ",
                   tuple_text(target.sizes()));
      target.detach().copy_(source);
      continue;
    }
    DTensor destination = shard_dtensor(*managed);
    at::Tensor local;
    if (std::holds_alternative<DTensor>(value)) {
      const DTensor& d = std::get<DTensor>(value);
      HP_CHECK_ARG(d.sizes() == destination.sizes(), "load '", key, "': DTensor of global shape ",
                   shape_text(d.sizes()), " does not match the parameter's global shape ",
                   shape_text(destination.sizes()));
      local = d.redistribute(destination.layout()).local();
    } else {
      const at::Tensor& t = std::get<at::Tensor>(value);
      const auto& local_shape = destination.local().sizes();
      if (t.sizes() == local_shape) {
        local = t;
      } else if (t.sizes().vec() == destination.sizes()) {
        local = distribute_tensor(t.detach(), destination.layout()).local();
      } else {
        throw_argument_error(cat("load '", key, "': plain tensor shape ", tuple_text(t.sizes()),
                                 " matches neither local shard ", tuple_text(local_shape),
                                 " nor global ", tuple_text(destination.sizes()), "."));
      }
    }
    managed->param->local_shard().copy_(local);
  }
}

}  // namespace hp
