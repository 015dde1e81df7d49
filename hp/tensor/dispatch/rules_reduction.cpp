// Reductions. Summing over a sharded dim leaves each rank a partial sum
// (Partial), so no communication happens until the value is needed; a mean
// divides the local sum by the GLOBAL count, which stays right for uneven
// shards. Norms over a sharded tensor reduce |x|^p across the shards and
// return a Replicate value. Reading a scalar (item()) needs a Replicate one.
#include <ATen/ATen.h>

#include <cmath>

#include "hp/tensor/dispatch/rule_util.h"
#include "hp/tensor/redistribute_exec.h"
#include "hp/tensor/redistribute_plan.h"

namespace hp::dispatch {

namespace {

std::vector<int64_t> reduced_dims(const c10::IValue& v, int64_t nd) {
  std::vector<int64_t> dims;
  if (!v.isNone()) {
    for (int64_t d : v.toIntVector()) dims.push_back(wrap_dim(d, nd));
  }
  if (dims.empty()) {
    for (int64_t d = 0; d < nd; ++d) dims.push_back(d);
  }
  return dims;
}

struct Reduction {
  Layout need, out;
  Shape out_shape;
};

// Sum-like reduction of `dims` (keepdim or not).
Reduction plan_sum(const OpInput& self, const std::vector<int64_t>& dims, bool keepdim) {
  const int64_t nd = static_cast<int64_t>(self.shape.size());
  auto reduced = [&](int64_t d) { return std::find(dims.begin(), dims.end(), d) != dims.end(); };
  std::vector<int64_t> map(nd, -1);
  Shape out_shape;
  for (int64_t d = 0; d < nd; ++d) {
    if (reduced(d) && !keepdim) continue;
    map[d] = static_cast<int64_t>(out_shape.size());
    out_shape.push_back(reduced(d) ? 1 : self.shape[d]);
  }
  Layout need = self.layout;
  ShardSpec spec;
  spec.placements = self.layout.placements();
  for (auto& p : spec.placements) {
    if (p.is_partial() && p.reduce_op() != dist::ReduceOp::kSum &&
        p.reduce_op() != dist::ReduceOp::kAvg) {
      need = need.without_partial();
      p = Replicate();
    } else if (p.is_sharded()) {
      p = reduced(p.dim()) ? Partial() : p.with_dim(map[p.dim()]);
    }
  }
  return {need, Layout(self.layout.mesh(), std::move(spec)), out_shape};
}

// sum(self, dtype) / sum.dim_IntList(self, dims, keepdim, dtype) and mean
// alike: the reduced dims (all without the `dims_overload`), keepdim, and
// the plan of their sum.
struct SumCall {
  std::vector<int64_t> dims;
  bool has_dims;
  bool keepdim;
  OpPlan plan;
};

SumCall plan_sum_call(OpCall& call, const char* dims_overload) {
  const OpInput& self = call.input(0);
  const int64_t nd = static_cast<int64_t>(self.shape.size());
  SumCall s;
  s.has_dims = call.overload() == dims_overload;
  s.dims = s.has_dims ? reduced_dims(call.arg(1), nd) : reduced_dims(c10::IValue(), nd);
  s.keepdim = s.has_dims && call.bool_arg(2);
  Reduction r = plan_sum(self, s.dims, s.keepdim);
  s.plan.inputs = {r.need};
  s.plan.outputs.push_back({r.out, r.out_shape});
  return s;
}

OpPlan sum_rule(OpCall& call) { return plan_sum_call(call, "dim_IntList").plan; }

OpPlan mean_rule(OpCall& call) {
  SumCall s = plan_sum_call(call, "dim");
  const Shape& shape = call.input(0).shape;
  int64_t count = 1;
  for (int64_t d : s.dims) count *= shape[d];
  const size_t n = call.num_args();
  s.plan.kernel = [dims = s.dims, keepdim = s.keepdim, count, n,
                   has_dims = s.has_dims](torch::jit::Stack& stack) {
    at::Tensor self = stack[stack.size() - n].toTensor();
    const c10::IValue& dtype = stack.back();
    c10::optional<at::ScalarType> st =
        dtype.isNone() ? c10::nullopt : c10::optional<at::ScalarType>(dtype.toScalarType());
    at::Tensor sum = has_dims ? at::sum(self, dims, keepdim, st) : at::sum(self, st);
    replace_args_with(stack, n, {sum.div_(static_cast<double>(count))});
  };
  return s.plan;
}

// Full-tensor p-norm: sum |x|^p locally, add across shards, take the root.
OpPlan norm_rule(OpCall& call) {
  const OpInput& self = call.input(0);
  const int64_t nd = static_cast<int64_t>(self.shape.size());
  double p = 2.0;
  const c10::IValue& pv = call.arg(1);
  if (!pv.isNone()) p = pv.toScalar().toDouble();
  if (call.num_args() > 2 && !call.arg(2).isNone() && !call.arg(2).toIntVector().empty() &&
      static_cast<int64_t>(call.arg(2).toIntVector().size()) != nd) {
    throw_unsupported(call, "norms over some dims are not supported, only over the whole tensor");
  }
  Layout need = self.layout.without_partial();
  std::vector<int64_t> shard_mesh_dims;
  for (int64_t m = 0; m < need.mesh()->ndim(); ++m) {
    if (need.placements()[m].is_sharded()) shard_mesh_dims.push_back(m);
  }
  OpPlan plan;
  plan.inputs = {need};
  plan.outputs.push_back({Layout::replicated(call.mesh()), {}});
  const size_t n = call.num_args();
  const DeviceMeshPtr mesh = call.mesh();
  // linalg_vector_norm's dtype (its 5th argument) sets the computation's.
  c10::optional<at::ScalarType> dtype;
  if (call.name() == "aten::linalg_vector_norm" && n > 4 && !call.arg(4).isNone()) {
    dtype = call.arg(4).toScalarType();
  }
  plan.kernel = [p, n, mesh, shard_mesh_dims, dtype](torch::jit::Stack& stack) {
    at::Tensor self = stack[stack.size() - n].toTensor();
    if (dtype) self = self.to(*dtype);
    const bool inf = std::isinf(p);
    at::Tensor local = inf ? (self.numel() ? self.abs().max() : at::zeros({}, self.options()))
                           : self.abs().pow(p).sum();
    Placements partial(mesh->ndim(), Replicate());
    for (int64_t m : shard_mesh_dims) {
      partial[m] = inf ? Placement::partial(dist::ReduceOp::kMax) : Partial();
    }
    at::Tensor total = local;
    if (!shard_mesh_dims.empty()) {
      auto plan = plan_redistribute(Layout(mesh, partial).spec(), Layout::replicated(mesh).spec());
      total = execute_redistribute(*plan, local, *mesh, {});
    }
    if (!inf) total = total.pow(1.0 / p);
    replace_args_with(stack, n, {total.to(self.scalar_type())});
  };
  return plan;
}

OpPlan local_scalar_rule(OpCall& call) {
  OpPlan plan;
  plan.inputs = {Layout::replicated(call.mesh())};
  return plan;
}

}  // namespace

void register_reduction_rules() {
  register_rule("aten::sum", sum_rule, true);
  register_rule("aten::mean", mean_rule, true);
  register_rule("aten::norm.Scalar", norm_rule, true);
  register_rule("aten::norm.ScalarOpt_dim", norm_rule, true);
  register_rule("aten::linalg_vector_norm", norm_rule, true);
  register_rule("aten::_local_scalar_dense", local_scalar_rule, true);
}

}  // namespace hp::dispatch
