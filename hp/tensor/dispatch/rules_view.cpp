// Ops that move, split or join dims. Those that carry sizes (view, expand,
// split, as_strided) receive GLOBAL sizes from libtorch; the rules rewrite
// them into this rank's local sizes. A shard follows its dim wherever the
// dim goes; a dim that is split or merged keeps its shard only where the
// shard boundaries stay whole rows of the result (the outermost piece,
// divisible by the number of shards), otherwise it is gathered first.
#include <ATen/InferSize.h>
#include <c10/util/accumulate.h>

#include <numeric>

#include "hp/tensor/dispatch/rule_util.h"

namespace hp::dispatch {

namespace {

// Output layout with each Shard(d) renamed by `map` (-1: the dim is gone,
// which must not be sharded). Partial and Replicate carry over.
Layout remap(const Layout& in, const std::vector<int64_t>& map) {
  // The common case (a view that keeps the sharded dims where they are)
  // shares the input's spec instead of building an equal one.
  bool identity = true;
  for (const auto& p : in.placements()) identity &= !p.is_sharded() || map.at(p.dim()) == p.dim();
  for (const auto& entry : in.spec().orders) identity &= map.at(entry.first) == entry.first;
  if (identity) return in;
  ShardSpec spec;
  spec.placements = in.placements();
  for (auto& p : spec.placements) {
    if (p.is_sharded()) p = p.with_dim(map.at(p.dim()));
  }
  for (const auto& [dim, order] : in.spec().orders) {
    if (map.at(dim) >= 0) spec.orders[map.at(dim)] = order;
  }
  spec.canonicalize();
  return Layout(in.mesh(), std::move(spec));
}

// view / reshape: returns (input layout needed, output layout). Besides
// the rules above: a shard merged under unsharded outer dims ([B, H] ->
// [B*H] with H sharded, as matmul folds batch dims) becomes a
// StridedShard with B blocks, and splitting such a dim back gives the plain
// shard again.
std::pair<Layout, Layout> plan_view(const Layout& in_layout, const Shape& in, const Shape& out) {
  Layout need = in_layout;
  const int64_t nin = static_cast<int64_t>(in.size()), nout = static_cast<int64_t>(out.size());
  std::vector<int64_t> map(nin, -1);
  std::vector<int64_t> to_plain;                          // strided input dims that come out plain
  std::vector<std::pair<int64_t, int64_t>> to_strided;    // (input dim, blocks) that come out strided
  int64_t i = 0, o = 0;
  while (i < nin || o < nout) {
    // Size-1 dims stand alone.
    if (i < nin && in[i] == 1 && (o >= nout || out[o] != 1)) {
      need = need.unshard_dim(i);
      ++i;
      continue;
    }
    if (o < nout && out[o] == 1 && (i >= nin || in[i] != 1)) {
      ++o;
      continue;
    }
    if (i >= nin || o >= nout) break;
    const int64_t i0 = i, o0 = o;
    int64_t pin = in[i++], pout = out[o++];
    while (pin != pout) {
      if (pin < pout) {
        if (i >= nin) break;
        pin *= in[i++];
      } else {
        if (o >= nout) break;
        pout *= out[o++];
      }
    }
    const int64_t gi = i - i0, go = o - o0;
    auto product = [](const Shape& s, int64_t from, int64_t to) {
      int64_t p = 1;
      for (int64_t j = from; j < to; ++j) p *= s[j];
      return p;
    };
    // Sharded input dims of this group, of either kind.
    int64_t sharded = 0;
    for (int64_t d = i0; d < i; ++d) {
      for (const auto& p : in_layout.placements()) sharded += p.is_sharded() && p.dim() == d;
    }
    for (int64_t d = i0; d < i; ++d) {
      for (int64_t m = 0; m < in_layout.mesh()->ndim(); ++m) {
        const Placement& p = in_layout.placements()[m];
        if (!p.is_strided_shard(d)) continue;
        const int64_t n = in_layout.mesh()->size(m);
        if (gi == 1 && go == 1) {
          map[d] = o0;
          continue;
        }
        // Splitting a StridedShard(d, k) where the first out dims make up
        // exactly the k blocks: the next out dim is plainly sharded.
        int64_t e = o0, blocks = 1;
        while (gi == 1 && e < o && blocks < p.split_factor()) blocks *= out[e++];
        if (gi == 1 && blocks == p.split_factor() && e < o && out[e] % n == 0) {
          map[d] = e;
          to_plain.push_back(d);
        } else {
          need = need.unshard_dim(d);
        }
      }
    }
    for (int64_t d = i0; d < i; ++d) {
      // Plain Shard(d) placements: how many, and the ranks they split over.
      int64_t levels = 0, n = 1;
      for (int64_t m = 0; m < in_layout.mesh()->ndim(); ++m) {
        if (!in_layout.placements()[m].is_shard(d)) continue;
        ++levels;
        n *= in_layout.mesh()->size(m);
      }
      if (levels == 0) continue;
      const bool one_mesh_dim = levels == 1;
      if (gi == 1 && go == 1) {
        map[d] = o0;
      } else if (gi == 1 && out[o0] % n == 0) {
        map[d] = o0;  // the shard goes to the outermost piece
      } else if (go == 1 && sharded == 1 && in[d] % n == 0 && one_mesh_dim) {
        // Merged with unsharded dims: whole rows when it is outermost, else
        // its piece of each of the `outer` blocks (a StridedShard).
        map[d] = o0;
        const int64_t outer = product(in, i0, d);
        if (outer > 1) to_strided.emplace_back(d, outer);
      } else {
        need = need.unshard_dim(d);
      }
    }
  }
  Layout result = remap(need, map);
  if (to_plain.empty() && to_strided.empty()) return {need, result};
  ShardSpec spec = result.spec();
  for (int64_t m = 0; m < need.mesh()->ndim(); ++m) {
    const Placement& before = need.placements()[m];
    if (!before.is_sharded()) continue;
    const int64_t d = before.dim();
    if (std::find(to_plain.begin(), to_plain.end(), d) != to_plain.end()) {
      spec.placements[m] = Shard(map[d]);
    }
    for (const auto& [sd, k] : to_strided) {
      if (sd == d) spec.placements[m] = StridedShard(map[d], k);
    }
  }
  return {need, Layout(need.mesh(), std::move(spec))};
}

// view, _unsafe_view, _reshape_alias: arg 1 holds the global size.
OpPlan view_rule(OpCall& call) {
  const OpInput& self = call.input(0);
  const Shape size = call.ints_arg(1);
  const Shape out = checked_by_torch(
      call, [&] { return at::infer_size(size, c10::multiply_integers(self.shape)); });
  auto [need, out_layout] = plan_view(self.layout, self.shape, out);
  OpPlan plan;
  plan.inputs = {need};
  plan.outputs.push_back({out_layout, out});
  const Shape local = out_layout.local_shape(out);
  if (call.name() == "aten::_reshape_alias") {
    plan.kernel = [local](torch::jit::Stack& stack) {
      at::Tensor self = stack[stack.size() - 3].toTensor();
      replace_args_with(stack, 3, {self.view(local)});
    };
  } else {
    call.arg(1) = c10::IValue(local);
  }
  return plan;
}

// expand(self, size, implicit): new leading dims and size-1 dims broadcast.
OpPlan expand_rule(OpCall& call) {
  const OpInput& self = call.input(0);
  std::vector<int64_t> size = call.ints_arg(1);
  const int64_t nd = static_cast<int64_t>(size.size());
  const int64_t off = nd - static_cast<int64_t>(self.shape.size());
  Layout need = self.layout;
  for (int64_t d = 0; d < static_cast<int64_t>(self.shape.size()); ++d) {
    if (size[d + off] == -1) size[d + off] = self.shape[d];
    if (self.shape[d] != size[d + off]) need = need.unshard_dim(d);
  }
  std::vector<int64_t> map(self.shape.size());
  std::iota(map.begin(), map.end(), off);
  Layout out_layout = remap(need, map);
  OpPlan plan;
  plan.inputs = {need};
  plan.outputs.push_back({out_layout, size});
  call.arg(1) = c10::IValue(out_layout.local_shape(size));
  return plan;
}

// Ops that only permute dims: the shard follows its dim.
OpPlan permute_like(OpCall& call, const std::vector<int64_t>& perm) {
  const OpInput& self = call.input(0);
  std::vector<int64_t> map(perm.size());
  Shape out(perm.size());
  for (size_t j = 0; j < perm.size(); ++j) {
    map[perm[j]] = static_cast<int64_t>(j);
    out[j] = self.shape[perm[j]];
  }
  OpPlan plan;
  plan.inputs = {self.layout};
  plan.outputs.push_back({remap(self.layout, map), out});
  return plan;
}

std::vector<int64_t> identity_perm(size_t n) {
  std::vector<int64_t> p(n);
  std::iota(p.begin(), p.end(), 0);
  return p;
}

OpPlan t_rule(OpCall& call) {
  auto perm = identity_perm(call.input(0).shape.size());
  if (perm.size() == 2) std::swap(perm[0], perm[1]);
  return permute_like(call, perm);
}

OpPlan transpose_rule(OpCall& call) {
  const int64_t nd = static_cast<int64_t>(call.input(0).shape.size());
  auto perm = identity_perm(nd);
  std::swap(perm[wrap_dim(call.int_arg(1), nd)], perm[wrap_dim(call.int_arg(2), nd)]);
  return permute_like(call, perm);
}

OpPlan permute_rule(OpCall& call) {
  const int64_t nd = static_cast<int64_t>(call.input(0).shape.size());
  auto perm = call.ints_arg(1);
  for (auto& p : perm) p = wrap_dim(p, nd);
  return permute_like(call, perm);
}

// Ops that insert or remove one dim (which must not be sharded when removed).
OpPlan unsqueeze_rule(OpCall& call) {
  const OpInput& self = call.input(0);
  const int64_t nd = static_cast<int64_t>(self.shape.size());
  const int64_t dim = wrap_dim(call.int_arg(1), nd + 1);
  std::vector<int64_t> map(nd);
  Shape out = self.shape;
  out.insert(out.begin() + dim, 1);
  for (int64_t d = 0; d < nd; ++d) map[d] = d < dim ? d : d + 1;
  OpPlan plan;
  plan.inputs = {self.layout};
  plan.outputs.push_back({remap(self.layout, map), out});
  return plan;
}

OpPlan remove_dims(OpCall& call, const std::vector<int64_t>& removed) {
  const OpInput& self = call.input(0);
  const int64_t nd = static_cast<int64_t>(self.shape.size());
  Layout need = self.layout;
  std::vector<int64_t> map(nd, -1);
  Shape out;
  for (int64_t d = 0; d < nd; ++d) {
    if (std::find(removed.begin(), removed.end(), d) != removed.end()) {
      need = need.unshard_dim(d);
    } else {
      map[d] = static_cast<int64_t>(out.size());
      out.push_back(self.shape[d]);
    }
  }
  OpPlan plan;
  plan.inputs = {need};
  plan.outputs.push_back({remap(need, map), out});
  return plan;
}

OpPlan squeeze_rule(OpCall& call) {
  const OpInput& self = call.input(0);
  const int64_t nd = static_cast<int64_t>(self.shape.size());
  std::vector<int64_t> removed;
  if (call.num_args() > 1) {
    const int64_t d = wrap_dim(call.int_arg(1), nd);
    if (nd > 0 && self.shape[d] == 1) removed.push_back(d);
  } else {
    for (int64_t d = 0; d < nd; ++d) {
      if (self.shape[d] == 1) removed.push_back(d);
    }
  }
  return remove_dims(call, removed);
}

OpPlan select_rule(OpCall& call) {
  const int64_t nd = static_cast<int64_t>(call.input(0).shape.size());
  return remove_dims(call, {wrap_dim(call.int_arg(1), nd)});
}

// slice(self, dim, start, end, step): the sliced dim is gathered first.
OpPlan slice_rule(OpCall& call) {
  const OpInput& self = call.input(0);
  const int64_t nd = static_cast<int64_t>(self.shape.size());
  const int64_t dim = wrap_dim(call.int_arg(1), nd);
  const int64_t len = self.shape[dim];
  auto bound = [&](const c10::IValue& v, int64_t fallback) {
    if (v.isNone()) return fallback;
    int64_t x = v.toInt();
    if (x < 0) x += len;
    return std::min(std::max<int64_t>(x, 0), len);
  };
  const int64_t start = bound(call.arg(2), 0), end = bound(call.arg(3), len);
  const int64_t step = call.arg(4).toInt();
  Shape out = self.shape;
  out[dim] = end > start ? (end - start + step - 1) / step : 0;
  Layout need = self.layout.unshard_dim(dim);
  OpPlan plan;
  plan.inputs = {need};
  plan.outputs.push_back({need, out});
  return plan;
}

// split / split_with_sizes / unbind along a dim: gathered first if sharded.
std::vector<int64_t> split_sizes(int64_t len, int64_t split) {
  std::vector<int64_t> sizes;
  if (split <= 0) return {len};
  for (int64_t at = 0; at < len; at += split) sizes.push_back(std::min(split, len - at));
  if (sizes.empty()) sizes.push_back(0);
  return sizes;
}

OpPlan split_rule(OpCall& call) {
  const OpInput& self = call.input(0);
  const int64_t nd = static_cast<int64_t>(self.shape.size());
  const int64_t dim = wrap_dim(call.int_arg(2), nd);
  const bool with_sizes = call.arg(1).isIntList();
  std::vector<int64_t> sizes = with_sizes ? call.ints_arg(1)
                                          : split_sizes(self.shape[dim], call.int_arg(1));
  // Splitting a StridedShard(dim, k) into its k blocks: each block comes out
  // plainly sharded, and each rank splits its local into k equal parts.
  for (int64_t m = 0; m < call.mesh()->ndim(); ++m) {
    const Placement& p = self.layout.placements()[m];
    if (!p.is_strided_shard(dim)) continue;
    const int64_t k = p.split_factor();
    const bool blocks = static_cast<int64_t>(sizes.size()) == k &&
                        std::all_of(sizes.begin(), sizes.end(),
                                    [&](int64_t s) { return s * k == self.shape[dim]; });
    if (!blocks) break;
    ShardSpec spec = self.layout.spec();
    spec.placements[m] = Shard(dim);
    Layout out_layout(call.mesh(), std::move(spec));
    OpPlan plan;
    plan.inputs = {self.layout};
    Shape out = self.shape;
    out[dim] = sizes[0];
    for (int64_t b = 0; b < k; ++b) plan.outputs.push_back({out_layout, out});
    const int64_t local_block = self.local.size(dim) / k;
    if (with_sizes) {
      call.arg(1) = c10::IValue(std::vector<int64_t>(k, local_block));
    } else {
      call.arg(1) = c10::IValue(local_block);
    }
    return plan;
  }
  Layout need = self.layout.unshard_dim(dim);
  OpPlan plan;
  plan.inputs = {need};
  for (int64_t s : sizes) {
    Shape out = self.shape;
    out[dim] = s;
    plan.outputs.push_back({need, out});
  }
  return plan;
}

OpPlan unbind_rule(OpCall& call) {
  const OpInput& self = call.input(0);
  const int64_t nd = static_cast<int64_t>(self.shape.size());
  const int64_t dim = wrap_dim(call.int_arg(1), nd);
  OpPlan one = remove_dims(call, {dim});
  OpPlan plan;
  plan.inputs = one.inputs;
  for (int64_t i = 0; i < self.shape[dim]; ++i) plan.outputs.push_back(one.outputs[0]);
  return plan;
}

// cat / stack: every input takes the first one's layout (the joined dim
// unsharded for cat); a Partial survives only if all agree.
OpPlan join_rule(OpCall& call, bool stack) {
  const auto& ins = call.inputs();
  if (ins.empty()) throw_unsupported(call, "no tensors to join");
  const int64_t nd = static_cast<int64_t>(ins[0].shape.size());
  const int64_t dim = wrap_dim(call.int_arg(1), stack ? nd + 1 : nd);
  Layout target = ins[0].layout;
  for (const auto& in : ins) {
    if (in.layout.placements() != target.placements()) target = target.without_partial();
  }
  // k equal blocks, each plainly and evenly sharded along the joined dim on
  // one mesh dim: their local pieces joined are exactly a
  // StridedShard(dim, k) of the result (the backward of splitting one).
  if (!stack && ins.size() > 1) {
    for (int64_t m = 0; m < call.mesh()->ndim(); ++m) {
      const Placement& p = target.placements()[m];
      if (!p.is_shard(dim)) continue;
      const int64_t ranks = call.mesh()->size(m);
      bool blocks = target.mesh_dims_of(dim).size() == 1;
      for (const auto& in : ins) {
        blocks = blocks && in.layout == target && in.shape == ins[0].shape &&
                 in.shape[dim] % ranks == 0;
      }
      if (!blocks) break;
      ShardSpec spec = target.spec();
      spec.placements[m] = StridedShard(dim, static_cast<int64_t>(ins.size()));
      Shape out = ins[0].shape;
      out[dim] *= static_cast<int64_t>(ins.size());
      OpPlan plan;
      for (size_t k = 0; k < ins.size(); ++k) plan.inputs.push_back(target);
      plan.outputs.push_back({Layout(call.mesh(), std::move(spec)), out});
      return plan;
    }
  }
  if (!stack) target = target.unshard_dim(dim);
  OpPlan plan;
  Shape out = ins[0].shape;
  plan.inputs.assign(ins.size(), target);
  if (stack) {
    out.insert(out.begin() + dim, static_cast<int64_t>(ins.size()));
    std::vector<int64_t> map(nd);
    for (int64_t d = 0; d < nd; ++d) map[d] = d < dim ? d : d + 1;
    plan.outputs.push_back({remap(target, map), out});
  } else {
    // Empty 1-D tensors are skipped by cat; legacy behaviour.
    out[dim] = 0;
    for (const auto& in : ins) {
      if (!(in.shape.size() == 1 && in.shape[0] == 0)) out[dim] += in.shape[dim];
    }
    plan.outputs.push_back({target, out});
  }
  return plan;
}

// as_strided: only on a fully replicated tensor, where local == global.
OpPlan as_strided_rule(OpCall& call) {
  for (const auto& p : call.input(0).layout.placements()) {
    if (!p.is_replicate()) {
      throw_unsupported(call, "as_strided addresses global storage; only Replicate is supported");
    }
  }
  OpPlan plan;
  plan.inputs = call.input_layouts();
  plan.outputs.push_back({call.input(0).layout, call.ints_arg(1)});
  return plan;
}

}  // namespace

void register_view_rules() {
  // Every rule here handles StridedShard (it follows its dim, is gathered
  // where a view splits or merges it, and split/cat turn it into blocks).
  for (const char* op : {"aten::view", "aten::_unsafe_view", "aten::_reshape_alias"}) {
    register_rule(op, view_rule, true);
  }
  register_rule("aten::expand", expand_rule, true);
  register_rule("aten::t", t_rule, true);
  register_rule("aten::transpose.int", transpose_rule, true);
  register_rule("aten::permute", permute_rule, true);
  register_rule("aten::unsqueeze", unsqueeze_rule, true);
  register_rule("aten::squeeze", squeeze_rule, true);
  register_rule("aten::select.int", select_rule, true);
  register_rule("aten::slice.Tensor", slice_rule, true);
  register_rule("aten::split.Tensor", split_rule, true);
  register_rule("aten::split_with_sizes", split_rule, true);
  register_rule("aten::unbind.int", unbind_rule, true);
  register_rule("aten::cat", [](OpCall& c) { return join_rule(c, false); }, true);
  register_rule("aten::stack", [](OpCall& c) { return join_rule(c, true); }, true);
  register_rule("aten::as_strided", as_strided_rule, true);
}

}  // namespace hp::dispatch
