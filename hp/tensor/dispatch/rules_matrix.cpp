// Matrix products. Per mesh dim, (A, B) -> out for A [.., m, k] @ B [.., k, n]:
//   (S(m), R) -> S(m)      row-split A
//   (R, S(n)) -> S(n)      column-split B (column parallel)
//   (S(k), S(k)) -> P      contracted dim split (row parallel)
//   (P, R) / (R, P) -> P   a Partial operand stays Partial
//   (S(b), S(b)) -> S(b)   bmm's batch dim
//   (R, R) -> R
// Inputs matching none of these are redistributed to the nearest pattern
// (keeping whichever operand is sharded), so a shard is gathered only when
// no pattern can keep it.
#include "hp/tensor/dispatch/rule_util.h"

namespace hp::dispatch {

namespace {

struct Pattern {
  Placement a, b, out;
};

// The pattern for one mesh dim. `batch` is the number of leading batch dims
// (0 for mm, 1 for bmm).
Pattern choose(const Placement& pa, const Placement& pb, int64_t batch) {
  const int64_t m = batch, ka = batch + 1, kb = batch, n = batch + 1;
  // A strided shard of m or n passes through like a plain one (each output
  // row or column comes from one input row or column).
  auto on = [](const Placement& p, int64_t d) { return p.is_sharded() && p.dim() == d; };
  if (pa.is_replicate() && pb.is_replicate()) return {pa, pb, Replicate()};
  if (on(pa, m) && pb.is_replicate()) return {pa, pb, pa.with_dim(m)};
  if (pa.is_replicate() && on(pb, n)) return {pa, pb, pb.with_dim(n)};
  // The contracted dim split alike on both sides (a StridedShard pairs the
  // same permuted pieces on both): each rank's product is a partial sum.
  if (on(pa, ka) && on(pb, kb) && pa.split_factor() == pb.split_factor() &&
      pa.is_strided_shard() == pb.is_strided_shard()) {
    return {pa, pb, Partial()};
  }
  if (batch > 0 && on(pa, 0) && pa == pb) return {pa, pb, pa};
  if (pa.is_partial() && pb.is_replicate()) return {pa, pb, pa};
  if (pa.is_replicate() && pb.is_partial()) return {pa, pb, pb};
  // Redistribute to the nearest pattern.
  if (on(pa, m)) return {pa, Replicate(), pa.with_dim(m)};
  if (on(pb, n)) return {Replicate(), pb, pb.with_dim(n)};
  if (pa.is_shard(ka)) return {pa, Shard(kb), Partial()};
  if (pb.is_shard(kb)) return {Shard(ka), pb, Partial()};
  if (batch > 0 && on(pa, 0)) return {pa, pa, pa};
  if (batch > 0 && on(pb, 0)) return {pb, pb, pb};
  if (pa.is_partial()) return {pa, Replicate(), pa};
  if (pb.is_partial()) return {Replicate(), pb, pb};
  return {Replicate(), Replicate(), Replicate()};
}

// Plans a (batched) matmul whose operands are inputs `ia` and `ib`.
OpPlan plan_contraction(OpCall& call, size_t ia, size_t ib, int64_t batch, Shape out_shape) {
  const auto& mesh = call.mesh();
  const auto& A = call.input(ia);
  const auto& B = call.input(ib);
  Placements pa(mesh->ndim(), Replicate()), pb = pa, po = pa;
  for (int64_t d = 0; d < mesh->ndim(); ++d) {
    Pattern p = choose(A.layout.placements()[d], B.layout.placements()[d], batch);
    pa[d] = p.a;
    pb[d] = p.b;
    po[d] = p.out;
  }
  OpPlan plan;
  plan.inputs = call.input_layouts();
  auto keep_order = [](const Layout& have, Layout want) {
    return have.placements() == want.placements() ? have : want;
  };
  plan.inputs[ia] = keep_order(A.layout, Layout(mesh, pa));
  plan.inputs[ib] = keep_order(B.layout, Layout(mesh, pb));
  plan.outputs.push_back({Layout(mesh, po), std::move(out_shape)});
  return plan;
}

OpPlan mm_rule(OpCall& call) {
  if (call.inputs().size() != 2) throw_unsupported(call, "expected two tensor operands");
  const auto& a = call.input(0).shape;
  const auto& b = call.input(1).shape;
  return plan_contraction(call, 0, 1, 0, {a[0], b[1]});
}

OpPlan bmm_rule(OpCall& call) {
  if (call.inputs().size() != 2) throw_unsupported(call, "expected two tensor operands");
  const auto& a = call.input(0).shape;
  const auto& b = call.input(1).shape;
  return plan_contraction(call, 0, 1, 1, {a[0], a[1], b[2]});
}

// addmm(bias, A, B) = beta * bias + alpha * A @ B: the bias follows the
// product's placement (a Replicate bias is split locally, or partitioned
// when the product is Partial).
OpPlan addmm_rule(OpCall& call) {
  if (call.inputs().size() != 3) throw_unsupported(call, "expected three tensor operands");
  const auto& a = call.input(1).shape;
  const auto& b = call.input(2).shape;
  OpPlan plan = plan_contraction(call, 1, 2, 0, {a[0], b[1]});
  const Shape& bias = call.input(0).shape;
  const int64_t off = 2 - static_cast<int64_t>(bias.size());
  const auto& out = plan.outputs[0];
  Placements pbias(call.mesh()->ndim(), Replicate());
  for (int64_t d = 0; d < call.mesh()->ndim(); ++d) {
    const Placement& po = out.layout.placements()[d];
    if (po.is_sharded()) {
      const int64_t bd = po.dim() - off;
      if (bd >= 0 && bias[bd] != 1) pbias[d] = po.with_dim(bd);
    } else if (po.is_partial()) {
      pbias[d] = po;
    }
  }
  Layout want(call.mesh(), pbias);
  plan.inputs[0] = want.placements() == call.input(0).layout.placements() ? call.input(0).layout
                                                                          : want;
  return plan;
}

}  // namespace

void register_matrix_rules() {
  register_rule("aten::mm", mm_rule, true);
  register_rule("aten::bmm", bmm_rule, true);
  register_rule("aten::addmm", addmm_rule, true);
}

}  // namespace hp::dispatch
