// The PrivateUse1 fallback: every op on a tensor-form DTensor lands here,
// below autograd. It finds the op's sharding rule, redistributes the inputs
// the rule asks for, runs the op (or the rule's kernel) on the local shards
// and wraps the outputs with the layouts the rule derived.
//
// libtorch 1.13's dispatcher prefers an op's CompositeExplicitAutograd kernel
// over a backend fallback, so the fallback is also registered directly on
// PrivateUse1 for every aten op that has such a kernel; never on
// CompositeImplicitAutograd ops, which must keep decomposing into the ops
// that have rules.
#include <ATen/core/dispatch/Dispatcher.h>
#include <fmt/ranges.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdlib>
#include <iostream>
#include <memory>
#include <mutex>
#include <unordered_map>

#include "hp/tensor/dispatch/dtensor_impl.h"
#include "hp/tensor/dispatch/sharding_rule.h"
#include "hp/tensor/redistribute_exec.h"
#include "hp/tensor/redistribute_plan.h"
#include "hp/util/env.h"
#include "hp/util/error.h"
#include "hp/util/format.h"

namespace hp::dispatch {

namespace {

struct RuleTable {
  std::mutex mutex;
  std::unordered_map<std::string, RuleEntry> by_name;
};

RuleTable& rules() {
  static auto* table = new RuleTable();
  return *table;
}

Layout replicate_on(const DeviceMeshPtr& mesh) {
  return Layout(mesh, Placements(mesh->ndim(), Replicate()));
}

bool same_mesh(const DeviceMeshPtr& a, const DeviceMeshPtr& b) { return a == b || *a == *b; }

// Collects the DTensor (and plain) tensor arguments.
std::vector<OpInput> collect_inputs(const c10::OperatorHandle& op, torch::jit::Stack& stack,
                                    size_t first, size_t n, DeviceMeshPtr& mesh) {
  std::vector<OpInput> inputs;
  inputs.reserve(n);
  auto add = [&](const at::Tensor& t, size_t arg, int64_t element) {
    if (!t.defined()) return;
    OpInput in;
    in.arg = arg;
    in.element = element;
    if (DTensorImpl* impl = dtensor_impl(t)) {
      if (!mesh) {
        mesh = impl->layout().mesh();
      } else if (!same_mesh(mesh, impl->layout().mesh())) {
        throw_argument_error(cat(op.schema().name(), ": DTensor arguments live on different meshes (",
                                 mesh->describe(), " and ", impl->layout().mesh()->describe(),
                                 "); redistribute onto one mesh first"));
      }
      in.layout = impl->layout();
      in.shape = impl->global_shape();
      in.local = impl->local();
    } else {
      in.plain = true;
      in.shape = t.sizes().vec();
      in.local = t;
    }
    inputs.push_back(std::move(in));
  };
  for (size_t i = 0; i < n; ++i) {
    const c10::IValue& v = stack[first + i];
    if (v.isTensor()) {
      add(v.toTensor(), i, -1);
    } else if (v.isTensorList()) {
      auto list = v.toTensorList();
      for (size_t j = 0; j < list.size(); ++j) add(list.get(j), i, static_cast<int64_t>(j));
    } else if (v.isList()) {
      auto list = v.toList();
      for (size_t j = 0; j < list.size(); ++j) {
        c10::IValue e = list.get(j);
        if (e.isTensor()) add(e.toTensor(), i, static_cast<int64_t>(j));
      }
    }
  }
  for (auto& in : inputs) {
    if (in.plain) in.layout = replicate_on(mesh);
  }
  return inputs;
}

// HP_DTENSOR_LOG=1 prints every redistribute the rules insert (to stderr,
// one line each: the op, the input, the two layouts): where communication
// in a model comes from.
bool log_redistributes() {
  static const bool enabled = hp::env::get_bool("HP_DTENSOR_LOG", false);
  return enabled;
}

at::Tensor move_local(const OpInput& in, const Layout& target) {
  return redistribute_local(in.local, in.layout, target, in.shape);
}

// Puts the (redistributed) local shards where the DTensor arguments were.
void substitute_locals(torch::jit::Stack& stack, size_t first, const std::vector<OpInput>& inputs,
                       const std::vector<at::Tensor>& locals) {
  for (size_t k = 0; k < inputs.size(); ++k) {
    const OpInput& in = inputs[k];
    c10::IValue& v = stack[first + in.arg];
    if (in.element < 0) {
      v = locals[k];
    } else if (v.isTensorList()) {
      auto list = v.toTensorList().copy();
      list.set(in.element, locals[k]);
      v = list;
    } else {
      auto list = v.toList().copy();
      list.set(in.element, c10::IValue(locals[k]));
      v = list;
    }
  }
}

// Indices of the arguments the op writes to (in-place self, out=), per
// operator and thread.
const std::vector<size_t>& written_arguments(const c10::OperatorHandle& op) {
  thread_local std::unordered_map<const c10::OperatorName*, std::vector<size_t>> cache;
  auto it = cache.find(&op.operator_name());
  if (it != cache.end()) return it->second;
  std::vector<size_t> written;
  const c10::FunctionSchema& schema = op.schema();
  for (size_t i = 0; i < schema.arguments().size(); ++i) {
    const auto* alias = schema.arguments()[i].alias_info();
    if (alias && alias->isWrite()) written.push_back(i);
  }
  return cache.emplace(&op.operator_name(), std::move(written)).first->second;
}

void fallback(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack* stack) {
  const c10::FunctionSchema& schema = op.schema();
  const size_t n = schema.arguments().size();
  const size_t first = stack->size() - n;
  DeviceMeshPtr mesh;
  std::vector<OpInput> inputs = collect_inputs(op, *stack, first, n, mesh);
  HP_CHECK_ARG(mesh != nullptr, schema.name(), ": reached the DTensor dispatcher with no DTensor "
               "argument");

  // Originals of the written arguments: in-place and out= ops return them.
  const std::vector<size_t>& written = written_arguments(op);
  std::vector<c10::IValue> written_values;
  for (size_t i : written) written_values.push_back((*stack)[first + i]);

  OpCall call(op, *stack, first, std::move(inputs), mesh);
  const RuleEntry* rule = find_rule(op);
  if (!rule) throw_unsupported(call);
  if (!rule->strided_aware) {
    for (OpInput& in : call.inputs()) {
      if (!in.layout.has_strided()) continue;
      Layout plain = in.layout.without_strided(Layout::StridedAs::kReplicate);
      in.local = move_local(in, plain);
      in.layout = std::move(plain);
    }
  }
  OpPlan plan = rule->rule(call);
  const auto& ins = call.inputs();
  HP_CHECK_ARG(plan.inputs.size() == ins.size(), "sharding rule of ", call.describe(),
               " planned ", plan.inputs.size(), " inputs for ", ins.size());

  std::vector<at::Tensor> locals(ins.size());
  for (size_t k = 0; k < ins.size(); ++k) {
    if (log_redistributes() && ins[k].layout != plan.inputs[k]) {
      std::cerr << fmt::format("[hp dtensor] {}: input {} {} -> {}\n", call.describe(), k,
                               ins[k].layout.spec().str(), plan.inputs[k].spec().str());
    }
    const bool is_written =
        std::find(written.begin(), written.end(), ins[k].arg) != written.end();
    if (is_written && ins[k].layout != plan.inputs[k]) {
      throw_unsupported(call, cat("it writes to argument ", schema.arguments()[ins[k].arg].name(),
                                  " in place, which would have to change layout from ",
                                  to_string(ins[k].layout.placements()), " to ",
                                  to_string(plan.inputs[k].placements())));
    }
    locals[k] = move_local(ins[k], plan.inputs[k]);
  }
  substitute_locals(*stack, first, ins, locals);

  if (plan.kernel) {
    plan.kernel(*stack);
  } else {
    op.callBoxed(stack);
  }

  // Wrap the outputs.
  const auto& returns = schema.returns();
  const size_t out_first = stack->size() - returns.size();
  size_t spec = 0;
  size_t written_seen = 0;
  for (size_t r = 0; r < returns.size(); ++r) {
    c10::IValue& v = (*stack)[out_first + r];
    const auto* alias = returns[r].alias_info();
    if (alias && alias->isWrite() && written_seen < written_values.size()) {
      v = written_values[written_seen++];
      ++spec;
      continue;
    }
    if (v.isTensor() && !v.toTensor().defined()) {
      ++spec;  // an output the op was asked not to compute
    } else if (v.isTensor()) {
      HP_CHECK_ARG(spec < plan.outputs.size(), "sharding rule of ", call.describe(),
                   " planned too few outputs");
      const OutputSpec& s = plan.outputs[spec++];
      v = wrap_local(v.toTensor(), s.layout, s.shape);
    } else if (v.isTensorList()) {
      auto list = v.toTensorList();
      c10::List<at::Tensor> wrapped;
      for (size_t j = 0; j < list.size(); ++j) {
        HP_CHECK_ARG(spec < plan.outputs.size(), "sharding rule of ", call.describe(),
                     " planned too few outputs");
        const OutputSpec& s = plan.outputs[spec++];
        wrapped.push_back(wrap_local(list.get(j), s.layout, s.shape));
      }
      v = wrapped;
    }
  }
}

}  // namespace

OpCall::OpCall(const c10::OperatorHandle& op, torch::jit::Stack& stack, size_t first_arg,
               std::vector<OpInput> inputs, DeviceMeshPtr mesh)
    : op_(op),
      stack_(stack),
      first_arg_(first_arg),
      num_args_(op.schema().arguments().size()),
      inputs_(std::move(inputs)),
      mesh_(std::move(mesh)) {}

const std::string& OpCall::name() const { return op_.operator_name().name; }
const std::string& OpCall::overload() const { return op_.operator_name().overload_name; }

int64_t OpCall::int_arg(size_t i) const { return stack_[first_arg_ + i].toInt(); }
std::vector<int64_t> OpCall::ints_arg(size_t i) const {
  return stack_[first_arg_ + i].toIntVector();
}
bool OpCall::bool_arg(size_t i) const { return stack_[first_arg_ + i].toBool(); }

std::vector<Layout> OpCall::input_layouts() const {
  std::vector<Layout> layouts;
  layouts.reserve(inputs_.size());
  for (const auto& in : inputs_) layouts.push_back(in.layout);
  return layouts;
}

std::string OpCall::describe() const {
  std::string s = name();
  if (!overload().empty()) s += "." + overload();
  s += "(";
  for (size_t k = 0; k < inputs_.size(); ++k) {
    if (k) s += ", ";
    s += inputs_[k].plain ? "plain" : to_string(inputs_[k].layout.placements());
    s += "[" + fmt::format("{}", fmt::join(inputs_[k].shape, ", ")) + "]";
  }
  return s + ")";
}

// Rules are registered once, before the first op runs (ensure_registered),
// so the per-thread caches of find_rule never go stale.
void register_rule(const std::string& name, Rule rule, bool strided_aware) {
  auto& table = rules();
  std::lock_guard<std::mutex> lock(table.mutex);
  table.by_name[name] = RuleEntry{std::move(rule), strided_aware};
}

const RuleEntry* find_rule(const c10::OperatorHandle& handle) {
  // Per thread, by the operator's (stable) name object: the hot path is one
  // lookup without a lock or a string.
  const c10::OperatorName& op = handle.operator_name();
  thread_local std::unordered_map<const c10::OperatorName*, const RuleEntry*> resolved;
  auto hit = resolved.find(&op);
  if (hit != resolved.end()) return hit->second;
  // An out= overload has extra tensor arguments the functional rule does
  // not plan for: it needs a rule of its own.
  bool out_variant = false;
  for (const auto& argument : handle.schema().arguments()) out_variant |= argument.is_out();
  auto& table = rules();
  std::lock_guard<std::mutex> lock(table.mutex);
  const std::string full = op.overload_name.empty() ? op.name : op.name + "." + op.overload_name;
  auto it = table.by_name.find(full);
  if (it == table.by_name.end() && !out_variant) it = table.by_name.find(op.name);
  const RuleEntry* entry = it == table.by_name.end() ? nullptr : &it->second;
  resolved.emplace(&op, entry);
  return entry;
}

void throw_unsupported(const OpCall& call, const std::string& why) {
  throw_argument_error(cat(
      "DTensor: ", call.describe(), why.empty() ? " has no sharding rule" : " cannot run: " + why,
      ". Supported ops are listed in docs/design.md (\"DTensor op dispatch\"); convert to local "
      "tensors with hp::to_local() or redistribute the inputs to a supported layout"));
}

void ensure_registered() {
  static std::once_flag once;
  std::call_once(once, [] {
    register_pointwise_rules();
    register_matrix_rules();
    register_view_rules();
    register_view_backward_rules();
    register_reduction_rules();
    register_factory_rules();
    register_nn_rules();
    // Leaked on purpose: deregistering at exit races with other static
    // destructors that may still run ops.
    auto* fallback_lib =
        new torch::Library(torch::Library::IMPL, "_", c10::DispatchKey::PrivateUse1, __FILE__, __LINE__);
    fallback_lib->fallback(torch::CppFunction::makeFromBoxedFunction<&fallback>());
    auto* direct =
        new torch::Library(torch::Library::IMPL, "aten", c10::DispatchKey::PrivateUse1, __FILE__, __LINE__);
    auto& dispatcher = c10::Dispatcher::singleton();
    for (const c10::OperatorName& name : dispatcher.getAllOpNames()) {
      if (name.name.rfind("aten::", 0) != 0) continue;
      auto handle = dispatcher.findOp(name);
      if (!handle) continue;
      if (!handle->hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutograd) &&
          !handle->hasKernelForDispatchKey(
              c10::DispatchKey::CompositeExplicitAutogradNonFunctional)) {
        continue;
      }
      if (handle->hasKernelForDispatchKey(c10::DispatchKey::PrivateUse1)) continue;
      const std::string qualified =
          name.overload_name.empty() ? name.name : name.name + "." + name.overload_name;
      direct->impl(qualified.c_str(), torch::CppFunction::makeFromBoxedFunction<&fallback>());
    }
  });
}

}  // namespace hp::dispatch
