#include "hp/tensor/redistribute_plan.h"

#include <map>
#include <mutex>

#include <c10/util/Exception.h>

#include "hp/mesh/device_mesh.h"
#include "hp/util/error.h"

namespace hp {
namespace {

using Kind = RedistributeStep::Kind;

// The planner's working state: placements plus the full shard order of every
// sharded tensor dim.
struct State {
  Placements placements;
  std::map<int64_t, std::vector<int64_t>> order;

  static State of(const ShardSpec& spec) {
    State s{spec.placements, {}};
    for (const auto& p : spec.placements) {
      if (p.is_shard()) s.order[p.dim()] = spec.mesh_dims_of(p.dim());
    }
    return s;
  }
  ShardSpec spec() const {
    ShardSpec spec{placements, {}};
    for (const auto& [dim, mesh_dims] : order) {
      if (!mesh_dims.empty()) spec.orders[dim] = mesh_dims;
    }
    spec.canonicalize();
    return spec;
  }
  std::vector<int64_t>& dims_of(int64_t d) { return order[d]; }
};

class Planner {
 public:
  Planner(const ShardSpec& source, const ShardSpec& target)
      : cur_(State::of(source)), dst_(State::of(target)) {}

  std::vector<RedistributeStep> run() {
    const int64_t n = static_cast<int64_t>(cur_.placements.size());
    // 1. Partial dims that do not end as a shard: reduce them now.
    for (int64_t m = 0; m < n; ++m) {
      const Placement& p = cur_.placements[m];
      if (!p.is_partial() || dst_.placements[m] == p || dst_.placements[m].is_shard()) continue;
      emit(Kind::kAllReduce, m, -1, -1, p.reduce_op(), Replicate());
    }
    // 2. Undo shard levels the target does not keep, innermost first.
    for (auto& entry : cur_.order) {
      const int64_t d = entry.first;
      const size_t keep = kept_prefix(d);
      while (cur_.dims_of(d).size() > keep) {
        const int64_t m = cur_.dims_of(d).back();
        const Placement& want = dst_.placements[m];
        if (want.is_shard() && want.dim() != d && can_append(want.dim(), m)) {
          cur_.dims_of(d).pop_back();
          cur_.dims_of(want.dim()).push_back(m);
          emit(Kind::kAllToAll, m, d, want.dim(), dist::ReduceOp::kSum, want);
        } else {
          cur_.dims_of(d).pop_back();
          emit(Kind::kAllGather, m, d, -1, dist::ReduceOp::kSum, Replicate());
        }
      }
    }
    // 3. Add the target's shard levels, outermost first.
    for (const auto& [d, want] : dst_.order) {
      auto& have = cur_.dims_of(d);
      for (size_t i = have.size(); i < want.size(); ++i) {
        const int64_t m = want[i];
        const Placement p = cur_.placements[m];
        have.push_back(m);
        if (p.is_partial()) {
          emit(Kind::kReduceScatter, m, d, -1, p.reduce_op(), Shard(d));
        } else {
          emit(Kind::kChunk, m, d, -1, dist::ReduceOp::kSum, Shard(d));
        }
      }
    }
    // 4. Partition into the target's Partial dims.
    for (int64_t m = 0; m < n; ++m) {
      const Placement& want = dst_.placements[m];
      if (want.is_partial() && cur_.placements[m] != want) {
        emit(Kind::kPartition, m, -1, -1, want.reduce_op(), want);
      }
    }
    return std::move(steps_);
  }

 private:
  // Length of the common outer prefix of d's levels in the current and target state.
  size_t kept_prefix(int64_t d) {
    const auto& have = cur_.dims_of(d);
    const auto& want = dst_.dims_of(d);
    size_t k = 0;
    while (k < have.size() && k < want.size() && have[k] == want[k]) ++k;
    return k;
  }

  // Whether mesh dim m can become the next (innermost) level of tensor dim d
  // right now: d's current levels are exactly the target's outer levels.
  bool can_append(int64_t d, int64_t m) {
    const auto& have = cur_.dims_of(d);
    const auto& want = dst_.dims_of(d);
    if (have.size() >= want.size() || want[have.size()] != m) return false;
    for (size_t i = 0; i < have.size(); ++i) {
      if (have[i] != want[i]) return false;
    }
    return true;
  }

  // Records a step that sets mesh dim m to `to` (shard orders already updated).
  void emit(Kind kind, int64_t m, int64_t d, int64_t d2, dist::ReduceOp op, Placement to) {
    RedistributeStep step{kind, m, d, d2, op, 1, before_, {}};
    cur_.placements[m] = to;
    step.after = cur_.spec();
    before_ = step.after;
    steps_.push_back(std::move(step));
  }

  State cur_, dst_;
  ShardSpec before_ = cur_.spec();
  std::vector<RedistributeStep> steps_;
};

// A (source, target) pair as integers: every placement as (kind, dim or
// reduce op), then the explicit shard orders. Built on every redistribute,
// so it avoids formatting text (ShardSpec::str()).
using PlanKey = std::vector<int64_t>;

void append_key(PlanKey& key, const ShardSpec& spec) {
  key.push_back(static_cast<int64_t>(spec.placements.size()));
  for (const Placement& p : spec.placements) {
    key.push_back(p.is_shard() ? 0 : p.is_replicate() ? 1 : p.is_partial() ? 2 : 3);
    key.push_back(p.is_sharded() ? p.dim() : p.is_partial() ? static_cast<int64_t>(p.reduce_op()) : 0);
    key.push_back(p.split_factor());
  }
  key.push_back(static_cast<int64_t>(spec.orders.size()));
  for (const auto& [tensor_dim, mesh_dims] : spec.orders) {
    key.push_back(tensor_dim);
    key.push_back(static_cast<int64_t>(mesh_dims.size()));
    key.insert(key.end(), mesh_dims.begin(), mesh_dims.end());
  }
}

struct Cache {
  std::mutex mutex;
  std::map<PlanKey, std::shared_ptr<const RedistributePlan>> plans;
  PlanCacheStats stats;
};

Cache& cache() {
  static Cache* c = new Cache();  // never destroyed: used from static destructors too
  return *c;
}

const char* verb(const RedistributeStep& s) {
  switch (s.kind) {
    case Kind::kAllGather: return "all_gather";
    case Kind::kChunk: return "local chunk (no communication)";
    case Kind::kAllReduce: return "all_reduce";
    case Kind::kReduceScatter: return "reduce_scatter";
    case Kind::kAllToAll: return "all_to_all";
    case Kind::kPartition: return "local partition (no communication)";
    case Kind::kStridedAllGather: return "all_gather of strided blocks";
    case Kind::kStridedChunk: return "local strided chunk (no communication)";
  }
  return "?";
}

// Strided shards are moved through Replicate around the ordinary planner:
// gathered first where the target differs, chunked last where the source
// differs; one kept on both sides stays untouched (no other mesh dim may
// shard its tensor dim, so no ordinary step touches it).
std::vector<RedistributeStep> plan_steps(const ShardSpec& source, const ShardSpec& target) {
  const size_t n = source.placements.size();
  bool strided = false;
  for (size_t m = 0; m < n; ++m) {
    strided |= source.placements[m].is_strided_shard() || target.placements[m].is_strided_shard();
  }
  if (!strided) return Planner(source, target).run();
  std::vector<RedistributeStep> steps;
  ShardSpec cur = source;
  for (size_t m = 0; m < n; ++m) {
    const Placement& p = source.placements[m];
    if (!p.is_strided_shard() || target.placements[m] == p) continue;
    RedistributeStep step{Kind::kStridedAllGather, static_cast<int64_t>(m), p.dim(), -1,
                          dist::ReduceOp::kSum, p.split_factor(), cur, {}};
    cur.placements[m] = Replicate();
    step.after = cur;
    steps.push_back(std::move(step));
  }
  // The middle: both sides with every strided shard as Replicate.
  ShardSpec mid_src = cur, mid_dst = target;
  std::vector<size_t> kept;
  for (size_t m = 0; m < n; ++m) {
    if (mid_src.placements[m].is_strided_shard()) {
      kept.push_back(m);
      mid_src.placements[m] = Replicate();
    }
    if (mid_dst.placements[m].is_strided_shard()) mid_dst.placements[m] = Replicate();
  }
  for (RedistributeStep step : Planner(mid_src, mid_dst).run()) {
    for (size_t m : kept) {
      step.before.placements[m] = source.placements[m];
      step.after.placements[m] = source.placements[m];
    }
    cur = step.after;
    steps.push_back(std::move(step));
  }
  for (size_t m = 0; m < n; ++m) {
    const Placement& p = target.placements[m];
    if (!p.is_strided_shard() || source.placements[m] == p) continue;
    RedistributeStep step{Kind::kStridedChunk, static_cast<int64_t>(m), p.dim(), -1,
                          dist::ReduceOp::kSum, p.split_factor(), cur, {}};
    cur.placements[m] = p;
    step.after = cur;
    steps.push_back(std::move(step));
  }
  return steps;
}

}  // namespace

int64_t RedistributePlan::num_collectives() const {
  int64_t n = 0;
  for (const auto& s : steps_) n += s.communicates();
  return n;
}

std::string RedistributePlan::explain(const DeviceMesh* mesh) const {
  std::string out = cat("redistribute ", source_.str(), " -> ", target_.str(), ": ");
  if (steps_.empty()) return out + "nothing to do (same layout)";
  out += cat(steps_.size(), " step(s), ", num_collectives(), " collective(s)");
  for (const auto& s : steps_) {
    out += cat("\n  mesh dim ", s.mesh_dim);
    if (mesh) {
      out += cat(" ('", mesh->dim_names()[s.mesh_dim], "', ", mesh->size(s.mesh_dim), " ranks)");
    }
    out += cat(": ", s.before.placements[s.mesh_dim].str(), " -> ",
               s.after.placements[s.mesh_dim].str(), "  ", verb(s));
    switch (s.kind) {
      case Kind::kAllGather:
      case Kind::kChunk: out += cat(" along tensor dim ", s.tensor_dim); break;
      case Kind::kStridedAllGather:
      case Kind::kStridedChunk:
        out += cat(" along tensor dim ", s.tensor_dim, " (", s.split_factor, " blocks)");
        break;
      case Kind::kAllReduce: out += cat("(", dist::to_string(s.op), ")"); break;
      case Kind::kReduceScatter:
        out += cat("(", dist::to_string(s.op), ") along tensor dim ", s.tensor_dim);
        break;
      case Kind::kAllToAll:
        out += cat(" from tensor dim ", s.tensor_dim, " to tensor dim ", s.to_tensor_dim);
        break;
      case Kind::kPartition:
        out += s.op == dist::ReduceOp::kSum ? ": coordinate 0 keeps the value, others hold zeros"
                                            : ": every rank keeps the value";
        break;
    }
  }
  return out;
}

std::shared_ptr<const RedistributePlan> plan_redistribute(const ShardSpec& source,
                                                          const ShardSpec& target) {
  HP_CHECK_ARG(source.placements.size() == target.placements.size(), "redistribute: source ",
               to_string(source.placements), " and target ", to_string(target.placements),
               " have different numbers of mesh dims");
  PlanKey key;
  append_key(key, source);
  append_key(key, target);
  Cache& c = cache();
  {
    std::lock_guard<std::mutex> lock(c.mutex);
    auto it = c.plans.find(key);
    if (it != c.plans.end()) {
      ++c.stats.hits;
      return it->second;
    }
  }
  auto steps = plan_steps(source, target);
  // A planner bug, not a user mistake: an internal assertion, not ArgumentError.
  TORCH_INTERNAL_ASSERT(steps.empty() ? source == target : steps.back().after == target,
                        "redistribute plan from ", source.str(), " ends at ",
                        steps.empty() ? source.str() : steps.back().after.str(), " instead of ",
                        target.str());
  auto plan = std::make_shared<const RedistributePlan>(source, target, std::move(steps));
  std::lock_guard<std::mutex> lock(c.mutex);
  ++c.stats.misses;
  c.plans.emplace(key, plan);
  c.stats.size = static_cast<int64_t>(c.plans.size());
  return plan;
}

PlanCacheStats plan_cache_stats() {
  std::lock_guard<std::mutex> lock(cache().mutex);
  return cache().stats;
}

void clear_plan_cache() {
  std::lock_guard<std::mutex> lock(cache().mutex);
  cache().plans.clear();
  cache().stats = {};
}

}  // namespace hp
