// Options of fully_shard (F1, F7, F8 in docs/features.md).
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <variant>
#include <vector>

#include <ATen/core/Tensor.h>

#include "hp/mesh/device_mesh.h"
#include "hp/tensor/placement.h"

namespace hp {

// Mixed precision (F7). Unset dtypes mean "the parameter's own dtype".
struct MixedPrecisionPolicy {
  std::optional<at::ScalarType> param_dtype;   // all-gather and compute
  std::optional<at::ScalarType> reduce_dtype;  // gradient collectives
  std::optional<at::ScalarType> output_dtype;  // forward outputs cast to this
  bool cast_forward_inputs = true;             // floating inputs cast to param_dtype
  // Reduced gradients are not cast to the parameter's dtype nor put in
  // .grad: they accumulate, in the reduce dtype (which must then be fp32),
  // in the parameter's main grad (hp::main_grad(param)), and .grad stays
  // empty: the gradient is kept in fp32 beside low-precision parameters, so
  // accumulating it over steps and micro-batches loses nothing. The
  // optimizer must then read the main grads (clip_grad_norm_ reads .grad).
  bool apply_grad_on_fp32_main_grad = false;
};

// CPU offload of sharded parameters and gradients (F8): for parameters on a
// CUDA device, each shard and its gradient live in host memory (pinned when
// pin_memory), the optimizer steps there, and the shard is copied to the
// device for each all-gather. Parameters on CPU already live in host memory:
// accepted, nothing moves.
struct OffloadPolicy {
  enum class Kind { kNone, kCPU };
  Kind kind = Kind::kNone;
  bool pin_memory = true;

  static OffloadPolicy none() { return {}; }
  static OffloadPolicy cpu(bool pin_memory = true) { return {Kind::kCPU, pin_memory}; }
};

// What a unit does with its gathered parameters after forward, when a
// backward follows (FSDP2's four states):
//   std::nullopt (the default)  true for every unit but the root, false for
//              the root: the root's backward starts right after its forward
//              (the loss's head first), so freeing its parameters would only
//              gather them again at once. Resolved when the first forward
//              makes a unit the root.
//   true       free them; backward gathers them again. Costs one more
//              all-gather per unit and step; holds only the shards between
//              forward and backward. On the root too, when asked: that saves
//              its whole unsharded size (a GPT's embeddings and head) for the
//              whole backward, for one more all-gather.
//   false      keep them gathered until the end of backward: no gather in
//              backward, the unit's unsharded size held from forward to the
//              end of backward.
//   int N      keep this rank's piece of groups of N ranks (a divisor of the
//              shard size; N = 1 is false, the shard size is true): backward
//              gathers within the group only (intra-node when N is the ranks
//              per node), holding unsharded size / N.
// A forward without backward (no grad) frees them unless the setting is an
// explicit false: the root's reason to keep them does not hold there.
using ReshardAfterForward = std::optional<std::variant<bool, int64_t>>;
// The ranks a setting keeps a unit's parameters spread over after forward:
// the shard size (nullopt: the default for every unit but the root; true),
// 1 (false) or N. The root's default (it keeps them) is the unit's to apply.
int64_t ranks_after_forward(const ReshardAfterForward& setting, int64_t shard_size);

struct FullyShardOptions {
  // 1-D mesh: FSDP over its ranks; 2-D (replicate, shard): HSDP; a 2-D mesh
  // whose shard dim has size 1: DDP. Default: a 1-D mesh over the world.
  DeviceMeshPtr mesh;
  ReshardAfterForward reshard_after_forward;
  // Returns the Shard placement of a parameter, or nullopt for Shard(0).
  std::function<std::optional<Placement>(const at::Tensor& param)> shard_placement_fn;
  MixedPrecisionPolicy mp_policy;
  OffloadPolicy offload_policy;
  // Left alone entirely: not sharded, not reduced.
  std::vector<at::Tensor> ignored_params;
  // Managed but never sharded: gradients all-reduced over the whole mesh
  // (per parameter: over the shard ranks, then over the replicas; with
  // comm_fusion: see there).
  std::vector<at::Tensor> replicate_params;
  // One all-gather / reduce-scatter per unit over packed buffers (F12). The
  // unit's parameters kept whole (replicate_params, scalars) are not
  // gathered; their gradients are packed into one flat buffer per unit and
  // all-reduced over every rank of the mesh in one collective, beside the
  // reduce-scatter (and, HSDP, the replicas' all-reduce) of the sharded
  // ones. With set_requires_all_reduce(false) on HSDP or DDP that
  // all-reduce, which reaches the replicas, is not issued: their
  // gradients are kept unreduced, as in a no-sync micro-batch, and the
  // next backward with all-reduce reduces them together with its own, so
  // that they end up as without the setter.
  // Unset: on for parameters on a GPU that share one dtype (per-parameter
  // collectives cost a kernel launch and a stream hop each there:
  // docs/streams.md), off on the CPU, where Gloo's coalesced gather writes
  // straight into the parameters.
  std::optional<bool> comm_fusion;
  // With comm_fusion: the shards live in one flat buffer (the all-gather's
  // input) that the optimizer updates in place (default: on with
  // comm_fusion). Parameters kept whole are not in it: they hold their own
  // tensors. Without comm_fusion there is no such buffer, so true is
  // refused (set comm_fusion = true as well, or leave it unset).
  std::optional<bool> comm_fusion_zero_copy;
};

}  // namespace hp
