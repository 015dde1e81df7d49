// The gradients of one fully_shard unit during one backward: how many are
// expected, which have arrived, and (comm_fusion) the packed buffers they are
// copied into until the last one arrives and the unit's reductions are issued:
// one reduce-scatter of the sharded parameters, and one all-reduce over the
// whole mesh of the parameters kept whole (replicate_params, scalars; all of
// them under DDP), each from one flat buffer.
//
// A fused root of other units receives gradients at both ends of backward
// (head first, embeddings last); its early gradients are deferred as they
// are and packed with the last, since packing the first would hold the
// whole root's buffer through every other unit's backward. On the streams
// (docs/streams.md) every unit defers them, as FSDP2 does: the sharded ones
// are packed by one kernel (PackedGrads::add_all) instead of a few copies per
// gradient, at the cost of holding the unit's full gradients until its last
// one arrives.
#pragma once

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

#include "hp/fsdp/fsdp_param.h"
#include "hp/fsdp/reduction.h"

namespace hp::fsdp {

class UnitGrads {
 public:
  // At the unit's pre-backward: expects one gradient per parameter that
  // requires one; `pack` prepares the fused buffers (comm_fusion with sync),
  // the whole parameters' only with `pack_whole` (else the unit keeps their
  // gradients unreduced and must not pack them).
  void begin(const std::vector<std::unique_ptr<FSDPParam>>& params, bool pack,
             bool pack_whole = true);
  // Counts one arrival; true when it was the last expected.
  bool arrive();
  // Some arrived, but not all (parameters unused in this backward).
  bool partly_arrived() const { return arrived_ > 0 && arrived_ < expected_; }

  // The position of this unit's first gradient in this backward (-1 before).
  int64_t wave() const { return wave_; }
  void set_wave(int64_t wave) { wave_ = wave; }

  // Fused: copies `grad` into the packed buffers (its memory can go at
  // once), or with `defer` keeps it as it is until flush(), which packs the
  // deferred sharded gradients at once.
  void pack(FSDPParam& param, at::Tensor grad, bool defer);
  // Fused: issues the reductions of everything packed (`scratch`: the unit's
  // lent unsharded buffer, which the reduce-scatter may receive into); the
  // whole parameters' over the mesh (ReduceSettings::over_mesh).
  void flush(ReductionQueue& queue, at::Tensor scratch, const MeshInfo& mesh,
             ReduceSettings settings, const std::shared_ptr<void>& keep_alive,
             CommContext* comm = nullptr);

  // Back to the state before begin(), dropping whatever was collected.
  void reset();

 private:
  int64_t expected_ = 0;
  int64_t arrived_ = 0;
  int64_t wave_ = -1;
  PackedGrads sharded_;
  PackedGrads whole_;
  std::vector<std::pair<FSDPParam*, at::Tensor>> deferred_;
};

}  // namespace hp::fsdp
