// Planning a redistribute (T4): the chain of per-mesh-dim moves that
// turns one ShardSpec into another.
//
// Moves, each on one mesh dim m:
//   S(d) -> R      all_gather along tensor dim d       (m innermost for d)
//   R -> S(d)      local chunk, no communication       (m becomes innermost)
//   P -> R         all_reduce
//   P -> S(d)      reduce_scatter along d
//   S(i) -> S(j)   all_to_all
//   R -> P         local partition (sum: coordinate 0 keeps the value)
// The planner first reduces Partial dims that do not end sharded (cheapest
// while the data is still sharded), then undoes the shards that the target
// does not keep, innermost level first, then adds the target's shards,
// outermost first, then partitions into Partial. A shard level of a
// multi-axis dim is kept only if every level outside it is kept too, so every
// step's collective sees contiguous pieces.
//
// Plans depend only on the two specs, so they are computed once per
// (source, target) pair and cached process-wide.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "hp/distributed/reduce_op.h"
#include "hp/tensor/shard_spec.h"

namespace hp {

class DeviceMesh;

struct RedistributeStep {
  enum class Kind {
    kAllGather, kChunk, kAllReduce, kReduceScatter, kAllToAll, kPartition,
    kStridedAllGather,  // StridedShard(d, k) -> R: all_gather, then interleave the k blocks
    kStridedChunk,      // R -> StridedShard(d, k): this rank's piece of each block, no communication
  };
  Kind kind;
  int64_t mesh_dim;
  int64_t tensor_dim = -1;     // gathered / chunked / scattered dim; all_to_all: source dim
  int64_t to_tensor_dim = -1;  // all_to_all: the newly sharded dim
  dist::ReduceOp op = dist::ReduceOp::kSum;
  int64_t split_factor = 1;    // strided steps: the number of blocks
  ShardSpec before;            // the spec this step starts from
  ShardSpec after;

  bool communicates() const {
    return kind != Kind::kChunk && kind != Kind::kPartition && kind != Kind::kStridedChunk;
  }
};

class RedistributePlan {
 public:
  RedistributePlan(ShardSpec source, ShardSpec target, std::vector<RedistributeStep> steps)
      : source_(std::move(source)), target_(std::move(target)), steps_(std::move(steps)) {}

  const std::vector<RedistributeStep>& steps() const { return steps_; }
  int64_t num_collectives() const;

  // One line per step, e.g.
  //   "mesh dim 1 ('tp', 2 ranks): S(0) -> R  all_gather along tensor dim 0"
  // `mesh` (optional) supplies dim names and sizes.
  std::string explain(const DeviceMesh* mesh = nullptr) const;

 private:
  ShardSpec source_, target_;
  std::vector<RedistributeStep> steps_;
};

// The (cached) plan from `source` to `target`; both must have the same number
// of placements and non-negative shard dims.
std::shared_ptr<const RedistributePlan> plan_redistribute(const ShardSpec& source,
                                                          const ShardSpec& target);

struct PlanCacheStats {
  int64_t hits = 0;
  int64_t misses = 0;
  int64_t size = 0;
};
PlanCacheStats plan_cache_stats();
void clear_plan_cache();

}  // namespace hp
