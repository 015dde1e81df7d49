// The parallel layout of a training run (A1, P2 in docs/features.md): how
// its mesh splits the work, and the fully_shard settings that change what
// each rank holds. hp-train builds one from its flags and the world, the
// benchmark from a row; parallelize, the memory plan and the benchmark's
// worker read it. Adding a dimension (a new mode) is a new enumerator, its
// row in parallel_layout.cpp's table and the sizes it sets.
//
// A value type: copyable, no threads, no collectives. Every check throws
// hp::ArgumentError naming the argument, its value and what was expected.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <c10/core/ScalarType.h>

#include "hp/fsdp/options.h"

namespace hp::plan {

// hp-train's --mode. fsdp: 1-D mesh (shard); hsdp: (replicate, shard); ddp:
// (replicate, shard) with a shard dim of one; tp: 1-D (tp): every layer
// split, every rank sees the same samples; fsdp_tp: (dp, tp), fully_shard
// over dp of the tensor-parallel pieces; none: one process, no mesh.
enum class ParallelMode { kNone, kFSDP, kHSDP, kDDP, kTP, kFSDPTP };

// "none", "fsdp", "hsdp", "ddp", "tp", "fsdp_tp".
const char* mode_name(ParallelMode mode);
// Every mode's name, in --mode's help order: fsdp, hsdp, ddp, tp, fsdp_tp, none.
std::vector<std::string> mode_names();
// The mode named `name`; throws naming `what` (e.g. "--mode") otherwise.
ParallelMode parse_mode(const std::string& name, const std::string& what);

enum class Dtype { kFloat32, kBFloat16, kFloat16 };
int64_t element_size(Dtype dtype);
const char* dtype_name(Dtype dtype);  // "fp32", "bf16", "fp16"
// "fp32" | "bf16" | "fp16"; throws naming `what` otherwise.
Dtype parse_dtype(const std::string& name, const std::string& what);
c10::ScalarType scalar_type(Dtype dtype);

// reshard_after_forward as fully_shard takes it (hp/fsdp/options.h):
// nullopt (fully_shard's default: true for every unit but the root), true,
// false or a group of N ranks.
// "true" | "false" | a positive N; throws naming `what` otherwise.
ReshardAfterForward parse_reshard_after_forward(const std::string& text, const std::string& what);
// "true", "false", "to groups of N".
std::string describe(const ReshardAfterForward& setting);

struct ParallelLayout {
  // mode none: no mesh.
  ParallelLayout() = default;
  // The mesh as init_device_mesh builds it (ddp: [N, 1]); its dim names
  // follow from the mode. Throws unless the shape has the mode's dims, all
  // of them positive.
  ParallelLayout(ParallelMode mode, std::vector<int64_t> mesh_shape);

  ParallelMode mode = ParallelMode::kNone;
  std::vector<int64_t> mesh_shape;      // empty for kNone
  std::vector<std::string> mesh_names;  // its dim names

  // fully_shard's settings for the blocks (the root keeps its parameters
  // after forward whatever this says; so does the last block, see
  // block_reshard_after_forward) and its mixed precision.
  ReshardAfterForward reshard_after_forward;
  Dtype param_dtype = Dtype::kFloat32;       // compute and all-gather
  std::optional<Dtype> reduce_dtype;         // gradient collectives; nullopt: param_dtype
  // --mode tp given fully_shard's flags: fully_shard units over a
  // data-parallel dim of one rank carry them (mixed precision, fusion).
  bool tp_units = false;
  // Pipeline stages under --mode ddp stay whole, the pipeline averaging
  // their gradients over the replicas; given fully_shard's flags they
  // become units over the (replicate, shard) mesh of this layout, a shard
  // dim of one rank, as --mode ddp's units outside a pipeline.
  bool ddp_stage_units = false;

  // Sizes, from the mesh's dims (1 where the mode has no such dim): the
  // tensor-parallel size; fully_shard's shard and replicate sizes; the
  // data-parallel size (ranks that see different samples).
  int64_t tp_size() const;
  int64_t shard_size() const;
  int64_t replicate_size() const;
  int64_t dp_size() const { return shard_size() * replicate_size(); }
  int64_t world_size() const;
  bool uses_fully_shard() const;
  // reshard_after_forward for block `block` (0-based, in forward order) of
  // `blocks`: the layout's, but false for the last block. Its backward is
  // the first to run, right after the root's head and the loss, so freeing
  // its parameters after forward would only gather them again at once (an
  // exposed all-gather at the start of every backward). torchtitan applies
  // FSDP2 the same way.
  ReshardAfterForward block_reshard_after_forward(int64_t block, int64_t blocks) const;
  // The mesh has a "tp" dim (even of one rank): the model's tensor-parallel plan applies.
  bool tensor_parallel() const;
  Dtype effective_reduce_dtype() const { return reduce_dtype.value_or(param_dtype); }

  // Coordinates of global rank `rank` on the row-major mesh, tp innermost:
  // the T ranks of one data-parallel group are adjacent.
  int64_t dp_rank(int64_t rank) const { return rank / tp_size(); }
  int64_t shard_rank(int64_t rank) const { return dp_rank(rank) % shard_size(); }
  int64_t tp_rank(int64_t rank) const { return rank % tp_size(); }

  // "fsdp on mesh [2] ['shard']: parameters sharded over 2 ranks,
  // data-parallel size 2", "none (one process, no process group)".
  std::string describe() const;

 private:
  int64_t dim_size(const char* name) const;
};

}  // namespace hp::plan
