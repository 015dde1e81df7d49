// The gathering side of a unit: how its parameters' shards become unsharded
// buffers (F4, F12 in docs/features.md).
//
// Without comm_fusion each sharded parameter is gathered by a collective of
// its own, straight into its unsharded buffer. With comm_fusion the unit
// issues one all-gather: the shards are packed into one flat input (with
// zero-copy they already live there, as views the optimizer updates in
// place, so nothing is copied in; mixed precision casts that flat buffer in
// one operation), and on completion the backend's thread copies the result
// out into the parameters' unsharded buffers, which are views of one flat
// buffer per unit. After reshard_after_forward = N, the parameters hold
// pieces for a group of N ranks instead, and the next gather runs there.
//
// Where streams order the work (CUDA; the recording StreamOps in tests),
// the gathers follow docs/streams.md instead: the inputs are copied in and
// one rank-major output is allocated on the copy-in stream, the collectives
// run on the all-gather stream, and finish_unshard() makes compute wait for
// them and copies out into the unsharded buffers (allocated on compute), so
// that no stream ever writes memory another stream allocated. Per-parameter
// collectives then gather into slices of that one output.
//
// Threads: driven by its unit's hooks (unit.h). On the host path the fused
// copy-out runs inside the backend's gather (Gloo copies each rank's piece
// into the unsharded views); nothing reads them before wait_unshard().
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "hp/distributed/work.h"
#include "hp/fsdp/comm_context.h"
#include "hp/fsdp/fsdp_param.h"
#include "hp/fsdp/mesh_info.h"

namespace hp::fsdp {

class ParamGroup {
 public:
  struct Options {
    bool fused = false;
    bool zero_copy = false;
  };
  // `params`: the unit's parameters that need unsharding (sharded or cast).
  ParamGroup(std::vector<FSDPParam*> params, const MeshInfo& mesh, Options options);
  // Waits for gathers in flight: their completion writes into this group.
  ~ParamGroup();

  bool empty() const { return params_.empty(); }

  // Deferred initialisation: gives the zero-copy flat shard buffer, if it
  // is still on meta, zeroed memory on the shards' device and materialises
  // the sharded parameters into it (FSDPParam::materialize, `new_param_for`
  // giving each one's replacement tensor). Parameters outside the flat
  // buffer are left to the caller.
  void materialize(const std::function<at::Tensor(FSDPParam&)>& new_param_for);
  bool fused() const { return options_.fused; }

  // Issues the gathers (from the shards, or from the regather pieces over
  // `regather_group` when the parameters hold them); idempotent while in
  // flight. With `snapshot` the gathers read copies of the shards, so the
  // shards may change (an optimizer step) before finish_unshard(); without,
  // zero-copy gathers read the live shards until they complete.
  // Parameters holding a current kept copy (reshard_keeping_unsharded) use
  // it and gather nothing; fused, only if every one of them is current, as
  // the unit gathers as one. Returns whether a kept copy was stale (the
  // shards changed since it was kept) and is being gathered again.
  // `comm`: the tree's streams (null: host order, or no tree yet).
  bool begin_unshard(dist::Group* regather_group, bool snapshot = false,
                     CommContext* comm = nullptr);
  // Waits, then points the parameters at their unsharded buffers. With
  // streams, `keep_output` (a forward) leaves the all-gather output to the
  // tree's CommContext until the next unit's unshard; else it is released
  // as soon as the copy-in stream waited the copy-out.
  void finish_unshard(bool keep_output = false);
  bool in_flight() const { return in_flight_; }
  // After a gather failed to complete: drops it (its result is not used).
  void forget_in_flight();

  // After forward: release the unsharded memory, keeping shapes.
  void free_unsharded();
  // reshard_after_forward = N: keep pieces for a group of N ranks, release
  // the rest.
  void keep_for_regather(int64_t pieces, int64_t index);
  // Parameters back to their shards, memory released; kept copies too
  // unless `keep_copies` (a reader of the shards does not make them stale).
  void reshard(bool keep_copies = false);
  // Parameters back to their shards, their gathered copies kept for the next
  // begin_unshard() (FSDPParam::reshard_keeping_unsharded); for a fused
  // group the flat buffer stays allocated until the copies are used,
  // released by reshard(), or found stale.
  void reshard_keeping_unsharded();
  // For a fused reduce-scatter: reshards and returns the flat unsharded
  // buffer with its memory (undefined when not fused or not unsharded); the
  // borrower releases it, and must be done before the next begin_unshard().
  at::Tensor reshard_lending_flat_buffer();

 private:
  void ensure_flat_unsharded();
  // begin_unshard()'s first step: kept copies still current are used, stale
  // ones released; returns whether one was stale.
  bool use_kept_copies();
  void release_flat_unsharded();
  // The stream path of begin_unshard / finish_unshard (see the file comment).
  void issue_on_streams(dist::Group& group, const std::vector<FSDPParam*>& todo, bool regather,
                        bool snapshot);
  void copy_out_from_streams(bool keep_output);
  // After the unsharded memory was released on compute (a reshard after
  // forward): the next gather's copy-in waits for it.
  void record_reshard();

  std::vector<FSDPParam*> params_;   // all that need unsharding
  std::vector<FSDPParam*> sharded_;  // the gathered ones
  const MeshInfo& mesh_;
  Options options_;
  bool in_flight_ = false;
  bool lent_ = false;  // the flat unsharded buffer is a reduce-scatter's scratch
  bool flat_kept_ = false;  // the flat unsharded buffer holds kept copies
  std::vector<dist::Work> works_;
  // What the gathers in flight will fill: only these are pointed at their
  // unsharded buffers when they land (others may be lent to a reduction).
  std::vector<FSDPParam*> arriving_;

  // The stream path's gather in flight: the rank-major output (on the
  // copy-in stream), its inputs (read on the all-gather stream until the
  // output is released), and where each gathered parameter's pieces are.
  CommContext* comm_ = nullptr;
  at::Tensor gather_output_;
  std::vector<at::Tensor> gather_inputs_;
  std::vector<FSDPParam*> gathered_;
  std::vector<int64_t> gather_offsets_;  // per gathered_ parameter, in elements of one rank
  int64_t gather_rank_numel_ = 0;        // elements per rank
  int64_t gather_ranks_ = 0;
  bool gather_fused_ = false;
  dist::StreamEvent reshard_event_;

  // Fused: one flat unsharded buffer (param-major) and, with zero-copy, one
  // flat shard buffer the shards live in, plus its cast in compute dtype.
  std::vector<int64_t> unsharded_offsets_;
  int64_t unsharded_total_ = 0;
  at::Tensor flat_unsharded_;
  std::vector<int64_t> shard_offsets_;
  int64_t shard_total_ = 0;
  at::Tensor flat_shards_;
  at::Tensor flat_cast_;
};

}  // namespace hp::fsdp
