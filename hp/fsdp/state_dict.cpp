#include "hp/fsdp/state_dict.h"

#include <torch/torch.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <map>
#include <set>

#include "hp/distributed/collectives.h"
#include "hp/distributed/world.h"
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
  return from_local(p.local_shard(), p.shard_layout(), {p.global_shape()});
}

// Every managed unit in the tree resharded, so parameters hold their shards.
// Reading them leaves copies kept after backward (reshard_after_backward)
// alone; a load frees them, as it replaces what they were gathered from.
void reshard_tree(const nn::Module& model, bool keep_copies) {
  for (auto& unit : fsdp::units_in_tree(model)) unit->reshard(keep_copies);
}

std::string shape_text(at::IntArrayRef shape) { return to_string(shape.vec()); }

// Python-style tuple text, as PyTorch's messages print shapes: "(2, 3)".
std::string tuple_text(at::IntArrayRef shape) {
  if (shape.size() == 1) return fmt::format("({},)", shape[0]);
  return fmt::format("({})", fmt::join(shape, ", "));
}

// One state-dict entry to load into `target`.
struct LoadStep {
  std::string key;
  const StateValue* value;
  at::Tensor target;
  std::optional<fsdp::ManagedParam> managed;
};

// Why `step` cannot be loaded on this rank (empty: it can). Local only.
std::string check_load_step(const LoadStep& step) {
  const std::string& key = step.key;
  const StateValue& value = *step.value;
  if (!step.managed) {
    at::IntArrayRef source = std::holds_alternative<DTensor>(value)
                                 ? at::IntArrayRef(std::get<DTensor>(value).sizes())
                                 : std::get<at::Tensor>(value).sizes();
    if (source == step.target.sizes()) return "";
    return cat("load '", key, "': tensor shape ", tuple_text(source),
               " does not match the parameter's shape ", tuple_text(step.target.sizes()));
  }
  DTensor destination = shard_dtensor(*step.managed);
  if (std::holds_alternative<DTensor>(value)) {
    const DTensor& d = std::get<DTensor>(value);
    if (d.sizes() == destination.sizes()) return "";
    return cat("load '", key, "': DTensor of global shape ", shape_text(d.sizes()),
               " does not match the parameter's global shape ", shape_text(destination.sizes()));
  }
  const at::Tensor& t = std::get<at::Tensor>(value);
  const auto& local_shape = destination.local().sizes();
  if (t.sizes() == local_shape || t.sizes().vec() == destination.sizes()) return "";
  return cat("load '", key, "': plain tensor shape ", tuple_text(t.sizes()),
             " matches neither local shard ", tuple_text(local_shape), " nor global ",
             tuple_text(destination.sizes()), ".");
}

// Copies a checked step's value into its parameter (collective for values
// that must be redistributed).
void run_load_step(const LoadStep& step) {
  const StateValue& value = *step.value;
  if (!step.managed) {
    at::Tensor source = std::holds_alternative<DTensor>(value)
                            ? std::get<DTensor>(value).full_tensor()
                            : std::get<at::Tensor>(value);
    step.target.detach().copy_(source);
    return;
  }
  DTensor destination = shard_dtensor(*step.managed);
  at::Tensor local;
  if (std::holds_alternative<DTensor>(value)) {
    local = std::get<DTensor>(value).redistribute(destination.layout()).local();
  } else {
    const at::Tensor& t = std::get<at::Tensor>(value);
    local = t.sizes() == destination.local().sizes()
                ? t
                : distribute_tensor(t.detach(), destination.layout()).local();
  }
  step.managed->param->local_shard().copy_(local);
}

// The minimum of `value` over every rank of the meshes `model`'s units shard
// over (a max-min over each mesh dim's group reaches the whole mesh). The
// meshes are visited in parameter order, the same on every rank.
int64_t agree_on_min(const nn::Module& model, int64_t value) {
  if (!dist::is_initialized()) return value;
  std::vector<const DeviceMesh*> meshes;
  for (const auto& item : model.named_parameters(/*recurse=*/true)) {
    auto managed = fsdp::find_managed(item.value());
    if (!managed) continue;
    const DeviceMesh* mesh = managed->unit->mesh().mesh.get();
    if (std::find(meshes.begin(), meshes.end(), mesh) == meshes.end()) meshes.push_back(mesh);
  }
  int64_t agreed = value;
  for (const DeviceMesh* mesh : meshes) {
    for (int64_t d = 0; d < mesh->ndim(); ++d) {
      dist::Group& group = mesh->group(d);
      // On the group's device: an NCCL group refuses CPU tensors.
      at::Tensor t = at::full({1}, agreed, at::TensorOptions(at::kLong).device(group.device()));
      dist::all_reduce(group, t, dist::ReduceOp::kMin).wait();
      agreed = t.item<int64_t>();
    }
  }
  return agreed;
}

}  // namespace

StateDict get_model_state_dict(const nn::Module& model, const StateDictOptions& options) {
  // Local DTensors are per rank by nature: dropping them on other ranks
  // would give a state dict no rank can load.
  HP_CHECK_ARG(!options.rank0_only || options.full_state_dict,
               "get_model_state_dict: rank0_only=true needs full_state_dict=true (only whole "
               "tensors can be kept on rank 0 alone), got full_state_dict=false");
  reshard_tree(model, /*keep_copies=*/true);
  const bool keep = !options.rank0_only || !dist::is_initialized() || dist::get_rank() == 0;
  auto placed = [&](const at::Tensor& t) { return options.cpu_offload ? t.cpu() : t; };
  StateDict out;
  for (const auto& item : model.named_parameters(/*recurse=*/true)) {
    auto managed = fsdp::find_managed(item.value());
    if (!managed) {
      if (keep) out.emplace_back(item.key(), placed(item.value().detach()));
      continue;
    }
    DTensor local = shard_dtensor(*managed);
    if (!options.full_state_dict) {
      if (options.cpu_offload) {
        FromLocalOptions shape;
        shape.shape = local.sizes();
        local = from_local(local.local().cpu(), local.layout(), shape);
      }
      out.emplace_back(item.key(), local);
      continue;
    }
    at::Tensor whole = local.full_tensor();  // collective: every rank gathers
    if (keep) out.emplace_back(item.key(), placed(whole));
  }
  for (const auto& item : model.named_buffers(/*recurse=*/true)) {
    if (keep) out.emplace_back(item.key(), placed(item.value().detach()));
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
  // Two passes: every entry is resolved and checked first, so a bad entry
  // leaves the model untouched; only then are values copied (with the
  // collectives that redistributing needs).
  std::vector<LoadStep> steps;
  int64_t first_rejected = static_cast<int64_t>(state_dict.size());
  std::string rejection;
  for (size_t i = 0; i < state_dict.size(); ++i) {
    const auto& [key, value] = state_dict[i];
    auto it = targets.find(key);
    if (it == targets.end()) continue;
    LoadStep step{key, &value, it->second, fsdp::find_managed(it->second)};
    rejection = check_load_step(step);
    if (!rejection.empty()) {
      first_rejected = static_cast<int64_t>(i);
      break;
    }
    steps.push_back(std::move(step));
  }
  // A rejection can depend on the rank (uneven local shard shapes): all
  // ranks agree on the first rejected entry, so none goes on alone into a
  // collective the others never join.
  const int64_t agreed = agree_on_min(model, first_rejected);
  if (agreed < static_cast<int64_t>(state_dict.size())) {
    if (agreed == first_rejected) throw_argument_error(rejection);
    throw_argument_error(cat("load '", state_dict[agreed].first,
                             "': rejected on another rank (see its error); nothing was loaded"));
  }
  reshard_tree(model, /*keep_copies=*/false);
  at::NoGradGuard no_grad;
  for (const auto& step : steps) run_load_step(step);
}

}  // namespace hp
