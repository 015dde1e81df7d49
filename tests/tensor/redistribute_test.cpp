// Every redistribute transition on every mesh dim of the 1-d, 2-d and 3-d
// meshes this world size allows (T4, T5): for each (source, target)
// pair, the source DTensor is built from the reference (not from the
// library), redistributed, and its local tensor compared exactly with the
// reference of the target; full_tensor() of the result must equal the
// whole tensor, and the collectives issued must be exactly the plan's, kind
// by kind. Shapes are uneven (and on 4 ranks leave some shards empty).
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <functional>

#include "hp/distributed/collectives.h"
#include "hp/distributed/world.h"
#include "hp/tensor/dtensor.h"
#include "hp/tensor/redistribute_plan.h"
#include "tests/support/tensor_checks.h"
#include "tests/tensor/comm_counter.h"
#include "tests/tensor/reference.h"

namespace hp {
namespace {

using test::PartialStyle;

std::vector<std::vector<int64_t>> mesh_shapes() {
  switch (dist::get_world_size()) {
    case 2: return {{2}, {1, 2}, {2, 1}, {1, 2, 1}};
    case 3: return {{3}, {3, 1}, {1, 3}, {1, 1, 3}};
    case 4: return {{4}, {2, 2}, {2, 1, 2}, {1, 2, 2}};
    case 8: return {{2, 2, 2}};
    default: return {{dist::get_world_size()}};
  }
}

std::vector<std::string> names_for(size_t ndim) {
  std::vector<std::string> all = {"a", "b", "c"};
  return std::vector<std::string>(all.begin(), all.begin() + ndim);
}

// All specs over `ndim` mesh dims whose per-dim placement comes from `options`,
// plus, for multi-axis shards, the reversed level order.
std::vector<ShardSpec> all_specs(int64_t ndim, const Placements& options) {
  std::vector<ShardSpec> specs;
  std::function<void(Placements)> rec = [&](Placements prefix) {
    if (static_cast<int64_t>(prefix.size()) == ndim) {
      specs.push_back({prefix, {}});
      for (int64_t d = 0; d < 2; ++d) {
        std::vector<int64_t> levels;
        for (int64_t m = 0; m < ndim; ++m) {
          if (prefix[m].is_shard(d)) levels.push_back(m);
        }
        if (levels.size() >= 2) {
          std::reverse(levels.begin(), levels.end());
          specs.push_back({prefix, {{d, levels}}});
        }
      }
      return;
    }
    for (const auto& p : options) {
      Placements next = prefix;
      next.push_back(p);
      rec(next);
    }
  };
  rec({});
  return specs;
}

// Builds the source DTensor on this rank straight from the reference.
DTensor source_dtensor(const at::Tensor& full, const Layout& layout) {
  std::vector<PartialStyle> styles(layout.mesh()->ndim(), PartialStyle::kTestPieces);
  at::Tensor local = test::reference_local(full, layout, layout.mesh()->coordinate(), styles);
  return from_local(local, layout, {full.sizes().vec()});
}

// Partial dims the plan leaves alone keep the source's pieces; new ones
// follow the library's partition convention.
std::vector<PartialStyle> target_styles(const Layout& src, const Layout& dst) {
  std::vector<PartialStyle> styles;
  for (size_t m = 0; m < dst.placements().size(); ++m) {
    styles.push_back(src.placements()[m] == dst.placements()[m] ? PartialStyle::kTestPieces
                                                                : PartialStyle::kPartition);
  }
  return styles;
}

// Whether y's local tensor is what this rank should hold. Partial target
// dims may be split any way that reduces to the value, except that dims the
// redistribute newly made Partial follow the library's partition convention
// exactly; so the check reduces y's Partial dims (with the facade, not the
// library's redistribute) and compares against the reference with those
// dims replicated, and compares partitions exactly when all Partial dims are new.
testing::AssertionResult matches_reference(const DTensor& y, const at::Tensor& full,
                                           const Layout& src) {
  const Layout& dst = y.layout();
  const DeviceMesh& mesh = *dst.mesh();
  auto styles = target_styles(src, dst);
  bool kept_partial = false;
  ShardSpec reduced = dst.spec();
  at::Tensor local = y.local().clone();
  for (int64_t m = 0; m < mesh.ndim(); ++m) {
    if (!dst.placements()[m].is_partial()) continue;
    kept_partial = kept_partial || styles[m] == PartialStyle::kTestPieces;
    dist::all_reduce(mesh.group(m), local, dst.placements()[m].reduce_op()).wait();
    reduced.placements[m] = Replicate();
  }
  if (!kept_partial) {
    auto exact = test::tensors_equal(y.local(), test::reference_local(full, dst,
                                                                      mesh.coordinate(), styles));
    if (!exact) return exact;
  }
  Layout replicated(dst.mesh(), reduced);
  return test::tensors_equal(
      local, test::reference_local(full, replicated, mesh.coordinate(), styles));
}

// Whether the collectives in `issued` are exactly the ones `plan` lists:
// its num_collectives() in all, and as many of each kind as it has steps.
testing::AssertionResult issued_as_planned(const dist::CommStats& issued,
                                           const RedistributePlan& plan) {
  using Kind = RedistributeStep::Kind;
  using dist::OpType;
  dist::CommStats want;
  for (const auto& step : plan.steps()) {
    switch (step.kind) {
      case Kind::kAllGather:
      case Kind::kStridedAllGather: ++want[OpType::kAllGather]; break;
      case Kind::kAllReduce: ++want[OpType::kAllReduce]; break;
      case Kind::kReduceScatter: ++want[OpType::kReduceScatter]; break;
      case Kind::kAllToAll: ++want[OpType::kAllToAll]; break;
      case Kind::kChunk:
      case Kind::kPartition:
      case Kind::kStridedChunk: break;
    }
  }
  if (issued.total() == plan.num_collectives() && issued.calls == want.calls) {
    return testing::AssertionSuccess();
  }
  return testing::AssertionFailure()
         << "the plan has " << plan.num_collectives() << " collective(s) ("
         << want.describe_calls() << ") but " << issued.total() << " were issued ("
         << issued.describe_calls() << ")\n";
}

// Runs every pair; returns the number of failures (reporting the first few).
// With check_whole, every result's full_tensor() must equal `full` too.
int check_all_pairs(const DeviceMeshPtr& mesh, const at::Tensor& full,
                    const std::vector<ShardSpec>& sources, const std::vector<ShardSpec>& targets,
                    bool check_whole = true) {
  int failures = 0;
  for (const auto& s : sources) {
    Layout src(mesh, s);
    DTensor x = source_dtensor(full, src);
    for (const auto& t : targets) {
      Layout dst(mesh, t);
      test::CommCounter counter;
      DTensor y = x.redistribute(dst);
      auto planned = issued_as_planned(counter.delta(), *plan_redistribute(s, t));
      auto same = matches_reference(y, full, src);
      auto whole_same = check_whole ? test::tensors_equal(y.full_tensor(), full)
                                    : testing::AssertionSuccess();
      if ((!same || !whole_same || !planned) && ++failures <= 5) {
        ADD_FAILURE() << "mesh " << to_string(mesh->shape()) << " shape "
                      << to_string(full.sizes().vec()) << ": " << s.str() << " -> " << t.str()
                      << " at coordinate " << to_string(mesh->coordinate()) << "\n"
                      << (same ? "" : same.message()) << (whole_same ? "" : whole_same.message())
                      << (planned ? "" : planned.message())
                      << "\nplan:\n"
                      << x.explain(dst);
      }
      EXPECT_EQ(y.sizes(), full.sizes().vec());
      EXPECT_EQ(y.layout(), dst);
    }
  }
  return failures;
}

// Sources for 3-d meshes: every placement appears on every mesh dim, mixed
// with the others, so with all targets every per-dim transition is covered
// (all pairs of 3-d layouts would take minutes of loopback latency).
std::vector<ShardSpec> three_d_sources() {
  const Placement R = Replicate(), S0 = Shard(0), S1 = Shard(1), P = Partial("sum");
  return {{{R, R, R}, {}},     {{S0, S0, S0}, {}}, {{S1, S1, S1}, {}}, {{P, P, P}, {}},
          {{S0, S1, P}, {}},   {{P, S0, S1}, {}},  {{S1, P, S0}, {}},  {{R, S0, S1}, {}},
          {{S0, R, S0}, {}},   {{S0, S0, R}, {{0, {1, 0}}}}};
}

TEST(Redistribute, EveryTransitionOnEveryMesh) {
  const Placements options = {Replicate(), Shard(0), Shard(1), Partial("sum")};
  for (const auto& shape : mesh_shapes()) {
    auto mesh = init_device_mesh("cpu", shape, names_for(shape.size()));
    auto specs = all_specs(mesh->ndim(), options);
    at::Tensor full = test::integer_tensor({7, 5});
    if (mesh->ndim() <= 2) {
      EXPECT_EQ(check_all_pairs(mesh, full, specs, specs), 0) << "mesh " << to_string(shape);
      // Fewer elements than shards: some ranks hold empty pieces.
      at::Tensor tiny = test::integer_tensor({3, 2});
      EXPECT_EQ(check_all_pairs(mesh, tiny, specs, specs, false), 0)
          << "mesh " << to_string(shape) << ", tensor [3, 2]";
    } else {
      EXPECT_EQ(check_all_pairs(mesh, full, three_d_sources(), specs, false), 0)
          << "mesh " << to_string(shape);
    }
  }
}

TEST(Redistribute, PartialAvgMaxMinToEveryLayout) {
  const Placements plain = {Replicate(), Shard(0), Shard(1)};
  for (const auto& shape : mesh_shapes()) {
    if (shape.size() > 2) continue;
    auto mesh = init_device_mesh("cpu", shape, names_for(shape.size()));
    at::Tensor full = test::integer_tensor({7, 5}, 1);
    for (const char* op : {"avg", "max", "min"}) {
      Placements with_op = plain;
      with_op.push_back(Partial(op));
      // Sources: exactly one Partial(op) dim; targets: anything without
      // Partial, or the same Partial(op), or Partial(sum).
      std::vector<ShardSpec> sources, targets;
      for (const auto& s : all_specs(mesh->ndim(), with_op)) {
        int partial = 0;
        for (const auto& p : s.placements) partial += p.is_partial();
        if (partial == 1) sources.push_back(s);
        if (partial <= 1) targets.push_back(s);
      }
      for (int64_t m = 0; m < mesh->ndim(); ++m) {
        ShardSpec to_sum{Placements(mesh->ndim(), Replicate()), {}};
        to_sum.placements[m] = Partial("sum");
        targets.push_back(to_sum);
      }
      EXPECT_EQ(check_all_pairs(mesh, full, sources, targets), 0) << "op " << op;
    }
  }
}

TEST(Redistribute, ThreeDimensionalTensorAndNegativeDims) {
  const int w = dist::get_world_size();
  auto mesh = init_device_mesh("cpu", w == 4 ? std::vector<int64_t>{2, 2}
                                             : std::vector<int64_t>{w, 1},
                               {"dp", "tp"});
  at::Tensor full = test::integer_tensor({5, 3, 6}, 2);
  std::vector<ShardSpec> specs;
  for (const auto& a : {Replicate(), Shard(0), Shard(2), Partial("sum")}) {
    for (const auto& b : {Replicate(), Shard(1), Shard(2)}) specs.push_back({{a, b}, {}});
  }
  EXPECT_EQ(check_all_pairs(mesh, full, specs, specs), 0);
  // Shard(-1) means the last dim.
  DTensor x = distribute_tensor(full, mesh, {Shard(-1), Replicate()});
  EXPECT_EQ(x.placements()[0], Shard(2));
  EXPECT_TRUE(test::tensors_equal(x.redistribute(Placements{Shard(0), Shard(-2)}).full_tensor(),
                                  full));
}

TEST(Redistribute, AliasFormMultiAxisOrder) {
  if (dist::get_world_size() != 4) GTEST_SKIP() << "needs a 2x2 mesh";
  auto mesh = init_device_mesh("cpu", {2, 2}, {"dp", "tp"});
  at::Tensor full = test::integer_tensor({9, 4}, 3);
  // ("tp", "dp"): tp is the outer level, dp varies fastest; each level
  // chunks what the level outside it left (9 rows -> [5, 4] -> [3, 2, 2, 2]).
  DTensor x = distribute_tensor(full, Layout::from_alias(mesh, {{"tp", "dp"}, {"None"}}));
  const auto c = mesh->coordinate();
  auto nested = [&](int64_t outer, int64_t inner) {
    return at::chunk(at::chunk(full, 2, 0)[outer], 2, 0)[inner].contiguous();
  };
  EXPECT_TRUE(test::tensors_equal(x.local(), nested(c[1], c[0])));
  EXPECT_EQ(x.layout().mesh_dims_of(0), (std::vector<int64_t>{1, 0}));
  // To the default order (dp outer) and back.
  DTensor y = x.redistribute(AliasPlacements{{"dp", "tp"}, {"None"}});
  EXPECT_TRUE(test::tensors_equal(y.local(), nested(c[0], c[1])));
  EXPECT_TRUE(test::tensors_equal(y.redistribute(x.layout()).local(), x.local()));
  EXPECT_TRUE(test::tensors_equal(x.full_tensor(), full));
}

}  // namespace
}  // namespace hp
