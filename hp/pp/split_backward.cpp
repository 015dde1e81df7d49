#include "hp/pp/split_backward.h"

#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/torch.h>

#include <algorithm>
#include <map>
#include <set>
#include <unordered_map>

#include "hp/util/error.h"

namespace hp::pp {

namespace ag = torch::autograd;
using NodePtr = decltype(ag::Edge::function);

namespace {

// Captures the gradients a node receives while `armed` (I only: W runs the
// node again and must not overwrite them).
class CaptureGrads : public ag::FunctionPreHook {
 public:
  CaptureGrads(ag::variable_list* into, const bool* armed) : into_(into), armed_(armed) {}
  ag::variable_list operator()(const ag::variable_list& grads) override {
    if (*armed_) *into_ = grads;
    return grads;
  }

 private:
  ag::variable_list* into_;
  const bool* armed_;
};

// For every node reachable from `root`: whether it reaches one of `targets`.
std::unordered_map<ag::Node*, bool> reaches(ag::Node* root, const std::set<ag::Node*>& targets) {
  std::unordered_map<ag::Node*, bool> memo;
  // Iterative post-order: graphs of a stage are thousands of nodes deep.
  std::vector<std::pair<ag::Node*, size_t>> stack{{root, 0}};
  memo[root] = targets.count(root) > 0;
  while (!stack.empty()) {
    auto& [node, next] = stack.back();
    const auto& edges = node->next_edges();
    if (next < edges.size()) {
      ag::Node* child = edges[next++].function.get();
      if (!child) continue;
      auto it = memo.find(child);
      if (it == memo.end()) {
        memo[child] = targets.count(child) > 0;
        stack.emplace_back(child, 0);
      }
      continue;
    }
    bool any = memo[node];
    for (const auto& edge : edges)
      if (edge.function && memo[edge.function.get()]) any = true;
    memo[node] = any;
    stack.pop_back();
  }
  return memo;
}

}  // namespace

struct SplitBackward::Captures {
  // A node where paths to parameters leave the input's part of the graph,
  // the gradients it received in I, and the accumulators W must reach from
  // it (through its edges that leave the input's part).
  struct Site {
    NodePtr node;
    ag::variable_list grads;
    ag::edge_list accumulators;
    ag::FunctionPreHook* hook = nullptr;
  };
  std::vector<Site> sites;
  bool armed = false;
  bool whole = false;  // no input part: W is the whole backward
};

SplitBackward::SplitBackward(at::Tensor output, at::Tensor input, std::vector<at::Tensor> params)
    : output_(std::move(output)), input_(std::move(input)), params_(std::move(params)) {}

SplitBackward::~SplitBackward() = default;

namespace {

void remove_hook(const NodePtr& node, const ag::FunctionPreHook* hook) {
  auto& hooks = node->pre_hooks();
  hooks.erase(
      std::remove_if(hooks.begin(), hooks.end(), [&](const auto& h) { return h.get() == hook; }),
      hooks.end());
}

}  // namespace

at::Tensor SplitBackward::backward_input(const at::Tensor& grad_output) {
  HP_CHECK_ARG(!input_done_, "SplitBackward: backward_input ran already");
  HP_CHECK_ARG(output_.defined() && output_.requires_grad(),
               "SplitBackward: the stage output has no graph");
  input_done_ = true;
  captures_ = std::make_unique<Captures>();
  ag::Node* root = output_.grad_fn().get();
  HP_CHECK_ARG(root != nullptr, "SplitBackward: the stage output has no grad_fn");

  std::map<ag::Node*, at::Tensor> accumulator_of;  // accumulator -> its parameter
  std::set<ag::Node*> param_nodes;
  for (const at::Tensor& p : params_) {
    if (!p.requires_grad()) continue;
    NodePtr acc = ag::impl::try_get_grad_accumulator(p);
    if (acc) {
      param_nodes.insert(acc.get());
      accumulator_of[acc.get()] = p;
    }
  }
  std::set<ag::Node*> input_nodes;
  NodePtr input_acc = input_.defined() ? ag::impl::try_get_grad_accumulator(input_) : NodePtr();
  if (input_acc) input_nodes.insert(input_acc.get());
  const auto to_input = reaches(root, input_nodes);
  if (input_nodes.empty() || !to_input.at(root)) {
    // Nothing of the output comes from the input (the first stage's ids):
    // W runs the whole backward, I has nothing to do.
    captures_->whole = true;
    grad_output_ = grad_output;
    return input_.defined() ? at::zeros_like(input_) : at::Tensor();
  }
  const auto to_params = reaches(root, param_nodes);

  // Sites: nodes of the input's part with an edge leaving it towards a
  // parameter. A parameter reached from two sites is used at two depths of
  // the stage: W from the upper site would run through the input's part into
  // the lower one and count that use twice.
  std::map<ag::Node*, ag::Node*> site_of_accumulator;
  std::vector<NodePtr> pending{output_.grad_fn()};
  std::set<ag::Node*> seen{root};
  while (!pending.empty()) {
    NodePtr node = std::move(pending.back());
    pending.pop_back();
    Captures::Site site;
    for (const auto& edge : node->next_edges()) {
      if (!edge.function) continue;
      ag::Node* child = edge.function.get();
      if (to_input.at(child)) {
        if (seen.insert(child).second) pending.push_back(edge.function);
      } else if (to_params.at(child)) {
        // Every accumulator below this edge (outside the input's part).
        std::vector<ag::Node*> below{child};
        std::set<ag::Node*> visited{child};
        while (!below.empty()) {
          ag::Node* n = below.back();
          below.pop_back();
          if (param_nodes.count(n)) {
            auto [it, inserted] = site_of_accumulator.emplace(n, node.get());
            HP_CHECK_ARG(inserted || it->second == node.get(),
                         "zero-bubble backward: a parameter of shape ",
                         accumulator_of.at(n).sizes(),
                         " is used at two places of the stage's graph; its weight gradient "
                         "cannot be split from the input gradient (use gpipe, 1f1b or "
                         "interleaved)");
            if (inserted) {
              site.accumulators.emplace_back(ag::impl::grad_accumulator(accumulator_of.at(n)), 0);
            }
          }
          for (const auto& e : n->next_edges())
            if (e.function && visited.insert(e.function.get()).second)
              below.push_back(e.function.get());
        }
      }
    }
    if (!site.accumulators.empty()) {
      site.node = node;
      captures_->sites.push_back(std::move(site));
    }
  }
  for (auto& site : captures_->sites) {
    auto hook = std::make_unique<CaptureGrads>(&site.grads, &captures_->armed);
    site.hook = hook.get();
    site.node->add_pre_hook(std::move(hook));
  }
  captures_->armed = true;
  ag::variable_list grads;
  try {
    grads = ag::grad({output_}, {input_}, {grad_output}, /*retain_graph=*/true,
                     /*create_graph=*/false, /*allow_unused=*/true);
  } catch (...) {
    for (auto& site : captures_->sites) remove_hook(site.node, site.hook);
    captures_->sites.clear();
    throw;
  }
  captures_->armed = false;
  for (auto& site : captures_->sites) {
    remove_hook(site.node, site.hook);
    site.hook = nullptr;
  }
  return grads[0].defined() ? grads[0] : at::zeros_like(input_);
}

void SplitBackward::backward_weight() {
  HP_CHECK_ARG(input_done_, "SplitBackward: backward_weight before backward_input");
  HP_CHECK_ARG(!weight_done_, "SplitBackward: backward_weight ran already");
  weight_done_ = true;
  if (captures_->whole) {
    ag::backward({output_}, {grad_output_});
    output_ = at::Tensor();
    grad_output_ = at::Tensor();
    return;
  }
  auto& engine = ag::Engine::get_default_engine();
  for (auto& site : captures_->sites) {
    ag::edge_list roots;
    ag::variable_list grads;
    for (size_t i = 0; i < site.grads.size(); ++i) {
      if (!site.grads[i].defined()) continue;
      roots.emplace_back(site.node, static_cast<uint32_t>(i));
      grads.push_back(site.grads[i]);
    }
    if (roots.empty()) continue;  // no gradient reached the site in I
    // Sites are disjoint below their edges out of the input's part, so each
    // call frees what it ran.
    engine.execute(roots, grads, /*keep_graph=*/false, /*create_graph=*/false,
                   /*accumulate_grad=*/true, site.accumulators);
    site.grads.clear();
  }
  captures_->sites.clear();  // the nodes, and with them the graph, go
  output_ = at::Tensor();
}

}  // namespace hp::pp
