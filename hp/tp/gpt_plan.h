// The tensor-parallel plan for hp::nn::GPT (S4 in docs/features.md),
// Megatron's layout expressed as parameter layouts; the DTensor op rules do
// the rest.
//
// On the mesh dim `tp_dim` (other mesh dims Replicate):
//  - attention: c_attn (the fused [q; k; v] projection, [3d, d]) is split by
//    output rows as StridedShard(0, 3), so each rank holds the q, k and v
//    rows of its own heads; the heads stay sharded through attention;
//    c_proj is split by input columns (Shard(1)): its output is a Partial
//    sum, reduced once where the residual adds it;
//  - MLP: c_fc split by output rows (Shard(0), weight and bias), c_proj by
//    input columns (Shard(1));
//  - embeddings: the token table split by vocabulary rows (Shard(0)): the
//    lookup gives a Partial sum, reduced where the position embedding is
//    added; lm_head split by vocabulary rows, so the logits come out sharded
//    by vocabulary and the cross-entropy runs on them without a gather
//    (loss parallel);
//  - LayerNorms, the position table and the row-parallel biases Replicate.
// Forward runs 2 all-reduces per block (after attention and after the MLP)
// and backward 2 more (where the residual stream's gradient adds the
// column-parallel inputs' Partial gradients), as Megatron's; plus one
// all-reduce of each LayerNorm's small weight and bias gradients.
//
// Parameter names and global shapes stay GPT-2's, so state dicts and
// exports read as the plain model's. Throws ArgumentError (before any
// collective) when n_head does not divide by the tp size or the mesh has no
// dim `tp_dim`.
#pragma once

#include <string>

#include "hp/mesh/device_mesh.h"
#include "hp/nn/gpt_config.h"
#include "hp/tp/sharding_plan.h"

namespace hp {

ShardingPlan gpt_tensor_parallel_plan(const nn::GPTConfig& config, const DeviceMesh& mesh,
                                      const std::string& tp_dim = "tp");

}  // namespace hp
