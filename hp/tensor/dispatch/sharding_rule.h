// Sharding rules: how one op runs on tensor-form DTensors.
//
// The fallback (op_dispatch.cpp) hands a rule an OpCall: the op, its
// arguments (DTensor arguments still in place), and one OpInput per DTensor
// argument with its layout, global shape and local shard. The rule returns
// an OpPlan: the layout every input must have (the fallback redistributes
// those that differ), the layout and global shape of every output, and,
// where the local op alone is not the answer (a softmax over a sharded dim,
// a loss over sharded logits), a kernel that computes the local outputs.
// A rule may rewrite non-tensor arguments (global sizes -> local sizes).
//
// Rules reason per mesh dim: each mesh dim's placement of the output follows
// from the inputs' placements on that dim, as in torch's DTensor.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>

#include "hp/tensor/layout.h"

namespace hp::dispatch {

using Shape = std::vector<int64_t>;

struct OpInput {
  size_t arg = 0;        // index among the op's arguments
  int64_t element = -1;  // index inside a tensor-list argument, else -1
  Layout layout;
  Shape shape;           // global
  at::Tensor local;
  bool plain = false;    // a plain tensor, counted as Replicate
};

struct OutputSpec {
  Layout layout;
  Shape shape;
};

struct OpPlan {
  // One per OpInput: the layout it must have before the local op runs.
  std::vector<Layout> inputs;
  // One per output tensor (tensor lists flattened), in schema order.
  std::vector<OutputSpec> outputs;
  // When set, runs instead of the op on the (local) arguments and leaves the
  // local outputs on the stack as the op would.
  std::function<void(torch::jit::Stack&)> kernel;
};

class OpCall {
 public:
  OpCall(const c10::OperatorHandle& op, torch::jit::Stack& stack, size_t first_arg,
         std::vector<OpInput> inputs, DeviceMeshPtr mesh);

  const c10::OperatorHandle& op() const { return op_; }
  const std::string& name() const;  // "aten::mm" (without overload)
  const std::string& overload() const;

  size_t num_args() const { return num_args_; }
  c10::IValue& arg(size_t i) { return stack_[first_arg_ + i]; }
  int64_t int_arg(size_t i) const;
  std::vector<int64_t> ints_arg(size_t i) const;
  bool bool_arg(size_t i) const;

  std::vector<OpInput>& inputs() { return inputs_; }
  const OpInput& input(size_t i) const { return inputs_.at(i); }
  const DeviceMeshPtr& mesh() const { return mesh_; }

  // The input layouts, unchanged (a starting point for plans).
  std::vector<Layout> input_layouts() const;
  // "aten::mm(S(0)[8, 4], R[4, 2])": what errors name.
  std::string describe() const;

 private:
  const c10::OperatorHandle& op_;
  torch::jit::Stack& stack_;
  size_t first_arg_;
  size_t num_args_;
  std::vector<OpInput> inputs_;
  DeviceMeshPtr mesh_;
};

using Rule = std::function<OpPlan(OpCall&)>;

struct RuleEntry {
  Rule rule;
  // Whether the rule handles StridedShard placements. Inputs of other rules
  // are made Replicate on the strided mesh dims first, so a rule written for
  // plain shards never misreads one.
  bool strided_aware = false;
};

// Rules by op name: "aten::mm" covers every overload, "aten::add.Tensor"
// one overload (looked up first).
void register_rule(const std::string& name, Rule rule, bool strided_aware = false);
const RuleEntry* find_rule(const c10::OperatorName& op);

// [[noreturn]] The error for an op without a rule, or a rule that cannot
// handle the placements it got.
[[noreturn]] void throw_unsupported(const OpCall& call, const std::string& why = "");

// Rule families (each in its own file), registered once by the fallback.
void register_pointwise_rules();
void register_matrix_rules();
void register_view_rules();
void register_reduction_rules();
void register_factory_rules();
void register_nn_rules();

}  // namespace hp::dispatch
