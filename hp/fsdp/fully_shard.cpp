#include "hp/fsdp/fully_shard.h"

#include <torch/torch.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <set>
#include <string_view>
#include <unordered_map>
#include <unordered_set>

#include "hp/distributed/world.h"
#include "hp/fsdp/dtensor_param.h"
#include "hp/fsdp/hook_check.h"
#include "hp/fsdp/registry.h"
#include "hp/fsdp/unit.h"
#include "hp/tensor/dtensor_tensor.h"
#include "hp/util/error.h"

namespace hp {
namespace {

using fsdp::FSDPParam;
using fsdp::Unit;

// "{Float, Half}"
std::string dtype_set(const std::set<at::ScalarType>& dtypes) {
  std::vector<std::string_view> names;
  for (at::ScalarType dtype : dtypes) names.emplace_back(c10::toString(dtype));
  return fmt::format("{{{}}}", fmt::join(names, ", "));
}

void validate_options(const FullyShardOptions& options) {
  const auto& mp = options.mp_policy;
  for (const auto& [name, dtype] : {std::make_pair("param_dtype", mp.param_dtype),
                                    std::make_pair("reduce_dtype", mp.reduce_dtype),
                                    std::make_pair("output_dtype", mp.output_dtype)}) {
    HP_CHECK_ARG(!dtype || at::isFloatingType(*dtype), "MixedPrecisionPolicy.", name,
                 " must be a floating-point dtype, got ", *dtype);
  }
  HP_CHECK_ARG(options.comm_fusion.value_or(true) || !options.comm_fusion_zero_copy.value_or(false),
               "fully_shard: comm_fusion_zero_copy=true needs comm_fusion=true, but comm_fusion "
               "is false: zero-copy keeps the shards in the unit's flat all-gather input "
               "buffer, which only comm_fusion builds; set comm_fusion=true, or leave "
               "comm_fusion_zero_copy unset (or false) for the per-parameter path");
  // reshard_after_forward as an int is checked against the shard size once
  // the mesh is known (Unit::check_reshard_after_forward).
  // OffloadPolicy::cpu(): parameters on a CUDA device keep their shards in
  // host memory (FSDPParam); on CPU there is nothing to move, so it is
  // accepted and changes nothing.
}

// The modules of `modules` that are not inside another one of them.
std::vector<std::shared_ptr<nn::Module>> root_modules(
    const std::vector<std::shared_ptr<nn::Module>>& modules) {
  std::vector<std::shared_ptr<nn::Module>> roots;
  for (const auto& candidate : modules) {
    bool inside = false;
    for (const auto& other : modules) {
      if (other == candidate) continue;
      for (const auto& sub : other->modules(/*include_self=*/false)) {
        if (sub.get() == candidate.get()) inside = true;
      }
    }
    if (!inside && std::find(roots.begin(), roots.end(), candidate) == roots.end()) {
      roots.push_back(candidate);
    }
  }
  return roots;
}

std::unordered_set<const c10::TensorImpl*> impls_of(const std::vector<at::Tensor>& tensors,
                                                    const char* what) {
  std::unordered_set<const c10::TensorImpl*> set;
  for (size_t i = 0; i < tensors.size(); ++i) {
    HP_CHECK_ARG(tensors[i].defined(), "fully_shard: ", what, "[", i, "] is an undefined tensor");
    set.insert(tensors[i].unsafeGetTensorImpl());
  }
  return set;
}

// The dim to shard `param` on; nullopt keeps it whole (a DTensor parameter
// whose layout leaves no dim free, dtensor_param.h).
std::optional<int64_t> shard_dim_for(const FullyShardOptions& options, const at::Tensor& param,
                                     const std::string& fqn, int64_t shard_size) {
  std::optional<Placement> placement;
  if (options.shard_placement_fn) placement = options.shard_placement_fn(param);
  if (!placement) {
    if (!is_dtensor(param)) return 0;
    return fsdp::default_shard_dim(layout_of(param), local_of(param).sizes().vec(), shard_size);
  }
  HP_CHECK_ARG(placement->is_shard(), "fully_shard: shard_placement_fn must return Shard(dim) or ",
               "nullopt, but returned ", placement->str(), " for parameter '", fqn, "'");
  const int64_t ndim = param.dim();
  int64_t dim = placement->dim();
  HP_CHECK_ARG(dim >= -ndim && dim < ndim, "fully_shard: shard_placement_fn returned ",
               placement->str(), " for parameter '", fqn, "' of shape ",
               to_string(param.sizes().vec()), ", out of range for ", ndim, " dims");
  if (dim < 0) dim += ndim;
  // A DTensor parameter is sharded through its local tensor, on a dim its
  // own layout leaves free.
  const at::Tensor& local = is_dtensor(param) ? local_of(param) : param;
  if (is_dtensor(param)) {
    for (const Placement& p : layout_of(param).placements()) {
      HP_CHECK_ARG(!(p.is_sharded() && p.dim() == dim), "fully_shard: shard_placement_fn returned ",
                   placement->str(), " for parameter '", fqn, "', but its layout ",
                   layout_of(param).str(), " already shards dim ", dim,
                   "; expected a dim the layout leaves whole");
    }
  }
  HP_CHECK_ARG(dim == 0 || local.size(dim) % shard_size == 0, "fully_shard: parameter '", fqn,
               "' of ", is_dtensor(param) ? "local shape " : "shape ",
               to_string(local.sizes().vec()), " cannot be sharded on dim ", dim, " over ",
               shard_size, " ranks: ", local.size(dim), " is not divisible by ", shard_size,
               " (only dim 0 is padded when uneven)");
  return dim;
}

// fully_shard without a mesh over a DTensor parameter. Units over the
// parameter's own mesh (gradients all-reduced over the dims it is replicated
// on) are not supported, so the message gives the call to make instead: the
// free dim of the mesh the parameter's was taken from, or else that mesh
// rebuilt with a data-parallel dim of size 1 in front.
std::string mesh_less_dtensor_message(const std::string& fqn, const Layout& layout) {
  const DeviceMesh& mesh = *layout.mesh();
  const DeviceMeshPtr root = mesh.root();
  const auto& used = mesh.dims_in_root();
  std::vector<std::string> free_dims;
  for (int64_t d = 0; d < root->ndim(); ++d) {
    if (std::find(used.begin(), used.end(), d) == used.end()) {
      free_dims.push_back(root->dim_names()[d]);
    }
  }
  const std::string head = cat("fully_shard: parameter '", fqn, "' is a DTensor on ",
                               mesh.describe(), ", and options.mesh is not set; expected ",
                               "options.mesh, a data-parallel sub-mesh of the mesh the "
                               "parameter's was taken from (fully_shard over a DTensor "
                               "parameter's own mesh is not supported). ");
  if (!free_dims.empty()) {
    return cat(head, "Pass options.mesh = mesh[\"", free_dims[0], "\"], where mesh is ",
               root->describe());
  }
  std::string dp = "dp";
  while (std::find(root->dim_names().begin(), root->dim_names().end(), dp) !=
         root->dim_names().end()) {
    dp = "_" + dp;
  }
  std::vector<std::string> shape{"1"}, names{"\"" + dp + "\""}, quoted;
  for (int64_t d = 0; d < root->ndim(); ++d) {
    shape.push_back(std::to_string(root->shape()[d]));
    quoted.push_back("\"" + root->dim_names()[d] + "\"");
    names.push_back(quoted.back());
  }
  const std::string sub =
      quoted.size() == 1 ? quoted[0] : fmt::format("{{{}}}", fmt::join(quoted, ", "));
  return cat(head, "For tensor parallelism alone, give the mesh a data-parallel dim of size 1: ",
             fmt::format("auto mesh = hp::init_device_mesh(\"{}\", {{{}}}, {{{}}});",
                         root->device_type(), fmt::join(shape, ", "), fmt::join(names, ", ")),
             " shard_module over mesh[", sub, "], then options.mesh = mesh[\"", dp, "\"]");
}

// What fully_shard does with one parameter it will manage.
struct ParamPlan {
  std::string fqn;
  at::Tensor param;
  int64_t shard_dim = 0;
  bool keep_whole = false;  // replicate_params and scalars
};

// The parameters `roots` will manage and how, after every check on them:
// nothing is changed here, and nothing is communicated.
std::vector<ParamPlan> plan_params(const std::vector<std::shared_ptr<nn::Module>>& roots,
                                   const FullyShardOptions& options, int64_t shard_size,
                                   const char* mode) {
  // Every parameter of the modules, by TensorImpl, with its name.
  std::vector<std::pair<std::string, at::Tensor>> candidates;
  std::unordered_set<const c10::TensorImpl*> in_modules;
  for (size_t i = 0; i < roots.size(); ++i) {
    const std::string prefix = roots.size() > 1 ? cat("[", i, "].") : "";
    for (const auto& item : roots[i]->named_parameters(/*recurse=*/true)) {
      if (!in_modules.insert(item.value().unsafeGetTensorImpl()).second) continue;  // tied
      candidates.emplace_back(prefix + item.key(), item.value());
    }
  }
  auto ignored = impls_of(options.ignored_params, "ignored_params");
  auto replicated = impls_of(options.replicate_params, "replicate_params");
  for (const auto& [what, set] : {std::make_pair("ignored_params", &ignored),
                                  std::make_pair("replicate_params", &replicated)}) {
    for (const c10::TensorImpl* impl : *set) {
      HP_CHECK_ARG(in_modules.count(impl), "fully_shard: ", what, " contains a tensor of shape ",
                   to_string(impl->sizes().vec()),
                   " that is not a parameter of the module(s) being sharded");
    }
  }

  std::vector<ParamPlan> plans;
  for (auto& [fqn, param] : candidates) {
    const c10::TensorImpl* impl = param.unsafeGetTensorImpl();
    HP_CHECK_ARG(!(ignored.count(impl) && replicated.count(impl)), "fully_shard: parameter '",
                 fqn, "' is in both ignored_params and replicate_params");
    if (ignored.count(impl)) continue;
    if (auto owner = fsdp::find_managed(param)) {
      // Owned by an inner unit (built first, as it should be) or by another
      // unit; a unit that contains this module means the order was reversed.
      for (const auto& outer : owner->unit->modules()) {
        for (const auto& sub : outer->modules(/*include_self=*/false)) {
          HP_CHECK_ARG(std::find_if(roots.begin(), roots.end(),
                                    [&](const auto& r) { return r.get() == sub.get(); }) ==
                           roots.end(),
                       "fully_shard: parameter '", fqn, "' is already managed by the unit of ",
                       outer->name(), ", which contains this module; apply fully_shard to "
                       "submodules before their parents");
        }
      }
      continue;
    }
    ParamPlan plan;
    plan.fqn = fqn;
    plan.param = param;
    plan.keep_whole = replicated.count(impl) > 0 || param.dim() == 0;
    if (is_dtensor(param)) {
      if (!options.mesh) throw_argument_error(mesh_less_dtensor_message(fqn, layout_of(param)));
      fsdp::check_composable(fqn, layout_of(param), *options.mesh);
    }
    if (!plan.keep_whole) {
      std::optional<int64_t> dim = shard_dim_for(options, param, fqn, shard_size);
      plan.keep_whole = !dim.has_value();
      plan.shard_dim = dim.value_or(0);
    }
    plans.push_back(std::move(plan));
  }
  // Mixed precision and the fused buffers need one dtype per unit. Only the
  // parameters that train are reduced, so only they must agree on it.
  const auto& mp = options.mp_policy;
  std::set<at::ScalarType> orig_dtypes, reduce_dtypes, all_dtypes;
  for (const auto& plan : plans) {
    const at::ScalarType orig = plan.param.scalar_type();
    all_dtypes.insert(orig);
    if (!plan.param.requires_grad()) continue;
    orig_dtypes.insert(orig);
    reduce_dtypes.insert(FSDPParam::reduce_dtype_for(orig, mp));
  }
  HP_CHECK_ARG(orig_dtypes.size() <= 1, mode, " expects uniform original parameter dtype but got ",
               dtype_set(orig_dtypes));
  HP_CHECK_ARG(reduce_dtypes.size() <= 1, mode, " expects uniform reduce dtype but got ",
               dtype_set(reduce_dtypes));
  HP_CHECK_ARG(!mp.apply_grad_on_fp32_main_grad || reduce_dtypes.empty() ||
                   *reduce_dtypes.begin() == at::kFloat,
               "MixedPrecisionPolicy.apply_grad_on_fp32_main_grad=true needs gradients reduced "
               "in fp32 (set reduce_dtype to Float), but they are reduced in ",
               dtype_set(reduce_dtypes));
  HP_CHECK_ARG(!options.comm_fusion.value_or(false) || all_dtypes.size() <= 1,
               "comm_fusion: All parameters in the group must have a uniform dtype, got ",
               dtype_set(all_dtypes));
  return plans;
}

// The device a unit's parameters live on: the mesh's. Without a mesh,
// the parameters choose: a GPU when any is on one (the default mesh is then
// 'cuda', as FSDP2 builds it on the current accelerator), else the CPU.
// Checked here, before any collective (fully_shard's caller may be the only
// rank with a misplaced module): a parameter on another GPU or on a GPU
// under a 'cpu' mesh raises naming it; a CPU parameter under a 'cuda' mesh
// is moved there later, with the unit's buffers, as FSDP2 does; a meta
// parameter's shard stays meta until to_empty gives it memory on this device
// (materialize.h); lazy init refuses one left there
// (Unit::validate_for_training).
c10::Device unit_device(const std::vector<ParamPlan>& plans, const DeviceMeshPtr& mesh,
                        const char* mode) {
  auto device_of = [](const ParamPlan& plan) {
    return (is_dtensor(plan.param) ? local_of(plan.param) : plan.param).device();
  };
  c10::Device device(c10::DeviceType::CPU);
  if (mesh) {
    device = mesh->device();
  } else if (std::any_of(plans.begin(), plans.end(),
                         [&](const ParamPlan& p) { return device_of(p).is_cuda(); })) {
    device = dist::local_cuda_device();
  }
  for (const auto& plan : plans) {
    const c10::Device at = device_of(plan);
    if (at == device || at.is_meta() || (at.is_cpu() && !is_dtensor(plan.param))) continue;
    const std::string mesh_text =
        mesh ? mesh->describe() : cat("the default mesh (on ", device, ", this rank's device)");
    throw_argument_error(cat(
        "fully_shard: parameter '", plan.fqn, "' is on ", at, " but ", mesh_text,
        " places this rank's ", mode, " shards on ", device,
        "; expected the module on the mesh's device: move it to ", device,
        device.is_cpu() ? ", or pass a 'cuda' mesh (init_device_mesh(\"cuda\", ...))"
                        : " (this rank's GPU is the LOCAL_RANK-th) before fully_shard"));
  }
  return device;
}

// Moves the CPU parameters and buffers of `roots` to `device` in place
// (their identity stays: an optimizer built before still holds them).
void move_states_to(const std::vector<std::shared_ptr<nn::Module>>& roots,
                    const std::vector<ParamPlan>& plans, c10::Device device) {
  if (device.is_cpu()) return;
  at::NoGradGuard no_grad;
  for (const auto& plan : plans) {
    at::Tensor param = plan.param;
    if (!is_dtensor(param) && param.device().is_cpu()) param.set_data(param.to(device));
  }
  for (const auto& root : roots) {
    for (auto& buffer : root->buffers(/*recurse=*/true)) {
      if (buffer.device().is_cpu()) buffer.set_data(buffer.to(device));
    }
  }
}

}  // namespace

int64_t ranks_after_forward(const ReshardAfterForward& setting, int64_t shard_size) {
  if (!setting) return shard_size;
  if (const bool* reshard = std::get_if<bool>(&*setting)) return *reshard ? shard_size : 1;
  return std::get<int64_t>(*setting);
}

FSDPModule fully_shard(const std::shared_ptr<nn::Module>& module,
                       const FullyShardOptions& options) {
  HP_CHECK_ARG(module != nullptr, "fully_shard: module must not be null");
  return fully_shard(std::vector<std::shared_ptr<nn::Module>>{module}, options);
}

FSDPModule fully_shard(const std::vector<std::shared_ptr<nn::Module>>& modules,
                       const FullyShardOptions& options) {
  // Everything is checked first, locally, so that an error leaves the model
  // exactly as it was (no parameter swapped to its shard, no group created)
  // and fully_shard can be called again with fixed options.
  HP_CHECK_ARG(!modules.empty(), "fully_shard does not support empty list of modules.");
  for (size_t i = 0; i < modules.size(); ++i) {
    HP_CHECK_ARG(modules[i] != nullptr,
                 "fully_shard expects a module or a list of modules, but got a list with a null "
                 "module at index ",
                 i, ".");
    HP_CHECK_ARG(!modules[i]->attachment<Unit>(fsdp::kUnitAttachment),
                 "fully_shard: module ", modules[i]->name(),
                 " is already managed by fully_shard; call it once per module");
  }
  validate_options(options);
  auto roots = root_modules(modules);
  fsdp::check_units_called_through_hooks(roots);
  const int64_t shard_size = options.mesh ? fsdp::MeshInfo::checked_shard_size(*options.mesh)
                                          : dist::get_world_size();
  // The mode the mesh selects, for messages (options.h).
  const char* mode = !options.mesh || options.mesh->ndim() == 1 ? "FSDP"
                     : shard_size == 1                          ? "DDP"
                                                                : "HSDP";
  auto plans = plan_params(roots, options, shard_size, mode);
  const int64_t regather_ranks = ranks_after_forward(options.reshard_after_forward, shard_size);
  Unit::check_reshard_after_forward(regather_ranks, shard_size, roots[0]->name());

  const c10::Device device = unit_device(plans, options.mesh, mode);
  // comm_fusion unset: one collective per unit on a GPU (per-parameter
  // collectives cost a launch and a stream hop each there), where the unit's
  // parameters share one dtype; per parameter on the CPU.
  std::set<at::ScalarType> dtypes;
  for (const auto& plan : plans) dtypes.insert(plan.param.scalar_type());
  const bool fused = options.comm_fusion.value_or(device.is_cuda() && dtypes.size() <= 1);
  HP_CHECK_ARG(fused || !options.comm_fusion_zero_copy.value_or(false),
               "fully_shard: comm_fusion_zero_copy=true needs comm_fusion=true, but comm_fusion "
               "is unset and off for these parameters (its default is on only for parameters "
               "on a GPU with one dtype): zero-copy keeps the shards in the unit's flat "
               "all-gather input buffer, which only comm_fusion builds; set comm_fusion=true, "
               "or leave comm_fusion_zero_copy unset (or false) for the per-parameter path");

  // Valid: build. The collective steps (the mesh's groups, the regather
  // group) come first, so that a failure there (a timeout, a peer that did
  // not call) leaves every parameter as it was.
  DeviceMeshPtr mesh = options.mesh;
  if (!mesh) {
    mesh = init_device_mesh(device.is_cuda() ? "cuda" : "cpu", {dist::get_world_size()}, {"dp"});
  }
  // comm_fusion all-reduces a unit's whole parameters (replicate_params,
  // scalars; every one on a shard dim of one rank) over the whole mesh.
  const bool has_whole = shard_size == 1 || std::any_of(plans.begin(), plans.end(),
                                                        [](const ParamPlan& p) {
                                                          return p.keep_whole;
                                                        });
  fsdp::MeshInfo mesh_info = fsdp::MeshInfo::from_mesh(mesh, fused && has_whole);
  dist::GroupPtr regather_group = Unit::regather_group_for(mesh_info, regather_ranks);

  move_states_to(roots, plans, device);

  // From here on parameters are swapped to their shards; should anything
  // raise, each one gets its whole data and gradient back.
  std::vector<std::pair<at::Tensor, at::Tensor>> originals;  // data, grad
  for (const auto& plan : plans) originals.emplace_back(plan.param.variable_data(), plan.param.grad());
  std::shared_ptr<Unit> unit;
  try {
    std::vector<std::unique_ptr<FSDPParam>> params;
    for (const auto& plan : plans) {
      params.push_back(std::make_unique<FSDPParam>(plan.param, plan.fqn, mesh_info, plan.shard_dim,
                                                   plan.keep_whole, options.mp_policy,
                                                   options.offload_policy));
    }
    fsdp::UnitFlags flags;
    flags.reshard_after_forward = options.reshard_after_forward;
    flags.reshard_after_forward_ranks = regather_ranks;
    fsdp::ParamGroup::Options group_options;
    group_options.fused = fused;
    group_options.zero_copy = options.comm_fusion_zero_copy.value_or(fused);
    unit = std::make_shared<Unit>(roots, mesh_info, std::move(params), flags, options.mp_policy,
                                  group_options, std::move(regather_group));
    unit->install_hooks();
  } catch (...) {
    unit.reset();
    for (size_t i = 0; i < plans.size(); ++i) {
      at::Tensor param = plans[i].param;
      param.set_data(originals[i].first);
      param.mutable_grad() = originals[i].second;
    }
    throw;
  }
  for (size_t i = 0; i < plans.size(); ++i) {
    fsdp::register_param(plans[i].param, unit, unit->params()[i].get());
  }
  for (const auto& root : roots) root->set_attachment(fsdp::kUnitAttachment, unit);
  return FSDPModule(roots[0]);
}

bool is_fully_sharded(const nn::Module& module) {
  return module.attachment<Unit>(fsdp::kUnitAttachment) != nullptr;
}

at::Tensor main_grad(const at::Tensor& param) {
  HP_CHECK_ARG(param.defined(), "main_grad: param must be a defined tensor");
  auto managed = fsdp::find_managed(param);
  HP_CHECK_ARG(managed.has_value(), "main_grad: the parameter of shape ",
               to_string(param.sizes().vec()), " is not managed by fully_shard");
  return managed->param->main_grad();
}

void UnshardHandle::wait() {
  for (auto& unit : units_) unit->wait_unshard();
  units_.clear();
}

FSDPModule::FSDPModule(std::shared_ptr<nn::Module> module) : module_(std::move(module)) {
  HP_CHECK_ARG(module_ != nullptr, "FSDPModule: module must not be null");
  HP_CHECK_ARG(is_fully_sharded(*module_), "FSDPModule: module ", module_->name(),
               " is not managed by fully_shard; call hp::fully_shard(module) first");
}

std::shared_ptr<Unit> FSDPModule::unit() const {
  return module_->attachment<Unit>(fsdp::kUnitAttachment);
}

std::vector<std::shared_ptr<Unit>> FSDPModule::units(bool recurse) const {
  if (!recurse) return {unit()};
  return fsdp::units_in_tree(*module_);
}

UnshardHandle FSDPModule::unshard(bool async_op) {
  auto u = unit();
  u->begin_unshard(/*snapshot=*/async_op);
  if (!async_op) {
    u->wait_unshard();
    return UnshardHandle();
  }
  return UnshardHandle({u});
}

void FSDPModule::reshard() { unit()->reshard(); }

void FSDPModule::set_requires_gradient_sync(bool requires_gradient_sync, bool recurse) {
  for (auto& u : units(recurse)) u->set_requires_gradient_sync(requires_gradient_sync);
}

void FSDPModule::set_requires_all_reduce(bool requires_all_reduce, bool recurse) {
  for (auto& u : units(recurse)) u->set_requires_all_reduce(requires_all_reduce);
}

void FSDPModule::set_reshard_after_forward(bool reshard_after_forward, bool recurse) {
  set_reshard_after_forward(ReshardAfterForward(reshard_after_forward), recurse);
}

void FSDPModule::set_reshard_after_forward(int64_t ranks, bool recurse) {
  set_reshard_after_forward(ReshardAfterForward(ranks), recurse);
}

void FSDPModule::set_reshard_after_forward(const ReshardAfterForward& setting, bool recurse) {
  // Validated for every unit before any change (and before any group is
  // made, which is collective).
  const auto tree = units(recurse);
  std::vector<int64_t> ranks;
  for (auto& u : tree) {
    ranks.push_back(ranks_after_forward(setting, u->mesh().shard_size));
    Unit::check_reshard_after_forward(ranks.back(), u->mesh().shard_size, u->name());
    u->check_can_change_reshard_after_forward();
  }
  std::vector<dist::GroupPtr> groups;
  for (size_t i = 0; i < tree.size(); ++i) {
    groups.push_back(Unit::regather_group_for(tree[i]->mesh(), ranks[i]));
  }
  for (size_t i = 0; i < tree.size(); ++i) {
    tree[i]->set_reshard_after_forward(setting, ranks[i], groups[i]);
  }
}

ReshardAfterForward FSDPModule::reshard_after_forward() const {
  return unit()->flags().reshard_after_forward;
}

void FSDPModule::set_reshard_after_backward(bool reshard_after_backward, bool recurse) {
  for (auto& u : units(recurse)) u->set_reshard_after_backward(reshard_after_backward);
}

void FSDPModule::set_is_last_backward(bool is_last_backward) {
  // One setting for the whole tree, whichever unit it is set through.
  for (auto& u : units(true)) u->set_is_last_backward(is_last_backward);
}

void FSDPModule::wait_for_gradients() {
  // Every root context the tree's units belong to (one, unless an inner
  // unit ran as a root of its own); a unit without one has run no forward,
  // so nothing of it is pending.
  std::vector<std::shared_ptr<fsdp::RootContext>> contexts;
  for (auto& u : units(true)) {
    const auto& context = u->context();
    if (context && std::find(contexts.begin(), contexts.end(), context) == contexts.end()) {
      contexts.push_back(context);
    }
  }
  for (auto& context : contexts) context->wait_for_gradients();
}

namespace {

// The root context of the tree `unit` is the root of, created when no
// forward has made one yet; ArgumentError when `unit` is an inner unit.
const std::shared_ptr<fsdp::RootContext>& pipeline_root_context(Unit& unit, const char* call) {
  unit.context_or_become_root();
  HP_CHECK_ARG(unit.is_root(), call, ": unit ", unit.name(), " belongs to the tree of unit ",
               unit.context()->root().name(), "; call it on that tree's root module");
  return unit.context();
}

}  // namespace

void FSDPModule::begin_pipeline_step() {
  pipeline_root_context(*unit(), "begin_pipeline_step")->begin_pipeline_step();
}

void FSDPModule::finish_pipeline_step() {
  pipeline_root_context(*unit(), "finish_pipeline_step")->finish_pipeline_step();
}

void FSDPModule::cancel_pipeline_step() noexcept {
  const auto& context = unit()->context();
  if (context && unit()->is_root()) context->cancel_pipeline_step();
}

void FSDPModule::set_reduce_op_type(const std::string& reduce_op_type, bool recurse) {
  HP_CHECK_ARG(reduce_op_type == "sum" || reduce_op_type == "avg", "Unsupported reduce op type ",
               reduce_op_type, ", supported types are ['sum', 'avg']");
  for (auto& u : units(recurse)) u->set_average(reduce_op_type == "avg");
}

void FSDPModule::set_implicit_prefetch(bool enabled, bool recurse) {
  for (auto& u : units(recurse)) u->set_implicit_prefetch(enabled);
}

namespace {

std::vector<std::weak_ptr<Unit>> units_of(const std::vector<FSDPModule>& modules) {
  std::vector<std::weak_ptr<Unit>> out;
  for (const auto& m : modules) {
    out.push_back(m.module().attachment<Unit>(fsdp::kUnitAttachment));
  }
  return out;
}

}  // namespace

void FSDPModule::set_modules_to_forward_prefetch(const std::vector<FSDPModule>& modules) {
  unit()->set_forward_prefetch(units_of(modules));
}

void FSDPModule::set_modules_to_backward_prefetch(const std::vector<FSDPModule>& modules) {
  unit()->set_backward_prefetch(units_of(modules));
}

void FSDPModule::zero_grad() {
  for (auto& u : units(true)) u->zero_grad();
}

StateDict FSDPModule::state_dict() const { return get_model_state_dict(*module_); }

}  // namespace hp
