// Gradient reduction of fully_shard units (F4, F5, F12 in docs/features.md).
//
// A GradReduction carries the full gradients of one parameter, or of a
// whole unit with comm_fusion, through its collectives:
//   sharded:    reduce-scatter over the shard ranks, then (HSDP, DDP) one
//               all-reduce over the replicas of everything it reduced (the
//               replicate bucket);
//   replicated: all-reduce over the shard ranks (replicate_params), then over
//               the replicas; with comm_fusion, one all-reduce over every
//               rank of the mesh of the unit's whole parameters at once (the
//               bucket ReduceSettings::over_mesh asks for).
// Each stage is issued asynchronously; advance() waits for the current one
// and issues the next, and the last assigns the reduced shards to .grad.
// The queue drives them: without fusion, a unit's first gradient completes
// the previous units' reductions (keeping the unsharded working set near two
// units); with fusion, issuing unit k moves every older reduction one stage
// on, so unit k+1's reduce-scatter overlaps unit k's backward and its
// all-reduce overlaps unit k's reduce-scatter (F12's pipeline).
//
// Threads: the queue is driven by the units' backward hooks and by the
// root's forward and wait_for_gradients (unit.h says which threads those
// are); the backend's thread only completes each stage's collective (the
// local sum, freeing a scratch buffer). Gradients are assigned on the
// driving thread, in advance() or complete_all().
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

#include "hp/distributed/group.h"
#include "hp/distributed/reduce_op.h"
#include "hp/distributed/work.h"
#include "hp/fsdp/comm_context.h"
#include "hp/fsdp/fsdp_param.h"
#include "hp/fsdp/mesh_info.h"

namespace hp::fsdp {

struct ReduceSettings {
  bool average = true;     // "avg": divide by the number of contributing ranks
  bool all_reduce = true;  // HSDP/DDP: all-reduce over replicas now
  // Whole parameters: one all-reduce over MeshInfo::mesh_group instead of
  // one over the shard ranks and one over the replicas. Such a reduction
  // always reaches every rank, so all_reduce = false must not reach it: the
  // unit keeps those gradients unreduced instead (unit.h).
  bool over_mesh = false;
};

// Gradients laid out for one reduction. Sharded: `data` is [shard_size,
// total] with params[i]'s rows (what each rank keeps) in a column block, as a
// reduce-scatter wants them; whole: `data` is [total], params[i]'s gradient
// at its offset. Gradients arrive one at a time (add() copies each in, so its
// full tensor can go at once) or all at once (add_all(): one kernel where it
// can); blocks of parameters that got none stay zero and their .grad
// untouched.
class PackedGrads {
 public:
  PackedGrads() = default;
  // params: all sharded or all whole; one reduce dtype.
  explicit PackedGrads(std::vector<FSDPParam*> params);
  // One parameter's gradient as it is (no copy when no padding is needed).
  static PackedGrads of(FSDPParam& param, at::Tensor full_grad);

  bool empty() const { return params_.empty(); }
  void add(FSDPParam& param, const at::Tensor& full_grad);
  // Every gradient of a sharded pack at once, before any add(): one
  // _chunk_cat writes the whole [shard_size, total] buffer (each gradient
  // chunked along dim 0 into shard_size padded rows, cast to the reduce
  // dtype) where every parameter has a gradient here, all are sharded along
  // dim 0 and the libtorch has the op (2.4 and later); otherwise one add()
  // each. Returns whether the one kernel packed them. The tensors are
  // released either way.
  bool add_all(std::vector<std::pair<FSDPParam*, at::Tensor>> grads);

 private:
  friend class GradReduction;
  void allocate();
  // Zeroes the blocks of the parameters no gradient arrived for.
  void zero_missing();

  std::vector<FSDPParam*> params_;
  std::vector<int64_t> offsets_;
  std::vector<bool> arrived_;
  int64_t total_ = 0;
  bool sharded_ = false;
  bool zeroed_ = false;  // data_ was zeroed whole when allocated
  at::Tensor data_;
};

class GradReduction {
 public:
  // Issues the first collective. `scratch` (may be undefined) is memory the
  // reduce-scatter may receive into; it is released when that completes.
  // `keep_alive` holds the owner of the params and mesh until done.
  // `comm`: the tree's streams; where they order the work (non-null
  // streams()), every stage is issued here, chained stream to stream, and
  // only complete() makes compute wait (docs/streams.md).
  GradReduction(PackedGrads grads, at::Tensor scratch, const MeshInfo& mesh,
                ReduceSettings settings, int64_t wave, std::shared_ptr<void> keep_alive,
                CommContext* comm = nullptr);

  // Waits for the current stage and issues the next; true once the reduced
  // gradients are assigned.
  bool advance();
  void complete();
  // Waits for the collective in flight and drops the gradients without
  // assigning them (a backward that failed); false if the wait failed.
  bool abandon() noexcept;
  bool done() const { return stage_ == Stage::kDone; }
  bool on_streams() const { return stage_ == Stage::kOnStreams; }
  int64_t wave() const { return wave_; }
  bool covers(const FSDPParam& param) const;

 private:
  enum class Stage {
    kReduceScatter,
    kShardAllReduce,
    kReplicaAllReduce,
    kMeshAllReduce,
    kOnStreams,  // every stage issued on the streams; complete() waits
    kDone
  };
  void start_replica_stage();
  void issue_on_streams(PackedGrads grads, CommContext& comm);
  dist::ReduceOp first_op(const dist::Group& group) const;
  // HSDP without all-reduce: the shard-reduced gradients wait in the
  // parameters for a backward with all-reduce.
  void keep_partial();
  // `non_blocking`: offloaded gradients are copied to the host
  // asynchronously where they can be (FSDPParam::assign_grad); the tree's
  // CommContext waits for them once.
  void assign(bool non_blocking = false);

  std::vector<FSDPParam*> params_;
  std::vector<int64_t> offsets_;
  std::vector<bool> arrived_;
  const MeshInfo& mesh_;
  ReduceSettings settings_;
  int64_t wave_;
  std::shared_ptr<void> keep_alive_;
  Stage stage_ = Stage::kDone;
  dist::Work work_;
  at::Tensor output_;   // the reduced values, flat
  at::Tensor scratch_;  // a lent buffer the reduce-scatter receives into
  dist::StreamOps* ops_ = nullptr;
  CommContext* comm_ = nullptr;  // on streams
  dist::StreamEvent post_reduce_;  // on streams: the last stage's event
};

class ReductionQueue {
 public:
  void push(std::unique_ptr<GradReduction> reduction);
  // Completes every reduction issued before `wave`.
  void complete_before(int64_t wave);
  // Moves every reduction issued before `wave` one stage on.
  void advance_before(int64_t wave);
  void complete_all();
  // Abandons every reduction (GradReduction::abandon); false if a
  // collective could not be waited for.
  bool abandon_all() noexcept;
  bool empty() const { return pending_.empty(); }
  bool pending_for(const FSDPParam& param) const;

 private:
  void drop_done();
  std::deque<std::unique_ptr<GradReduction>> pending_;
};

}  // namespace hp::fsdp
