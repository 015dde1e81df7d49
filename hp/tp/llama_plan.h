// The tensor-parallel plan for hp::nn::Llama (S6 in docs/features.md),
// Megatron's layout as parameter layouts; the DTensor op rules do the rest,
// rotary embedding and grouped-query attention included.
//
// On the mesh dim `tp_dim` (other mesh dims Replicate):
//  - attention: q_proj, k_proj and v_proj split by output rows (Shard(0),
//    colwise), so each rank holds whole query heads and the key/value heads
//    of their groups (query head h uses kv head h / (n_head / n_kv_head):
//    rank r's query heads r * n_head / tp ... use exactly its kv heads
//    r * n_kv_head / tp ...); o_proj split by input columns (Shard(1),
//    rowwise): its output is a Partial sum, reduced to Replicate as it
//    leaves the attention module (an output_plan entry), so the residual
//    stream and the RMSNorms read a Replicate tensor;
//  - MLP: gate_proj and up_proj colwise (Shard(0)), down_proj rowwise
//    (Shard(1)), its output reduced the same way;
//  - embed_tokens split by vocabulary rows (Shard(0)): the lookup gives a
//    Partial sum, reduced as it enters the first decoder layer; lm_head
//    split by vocabulary rows, so the logits come out sharded by vocabulary
//    and the cross-entropy runs on them (loss parallel);
//  - the RMSNorm weights Replicate (as DTensors, so their optimizer state is
//    one too).
//
// Forward runs 2 all-reduces per layer and one for the embedding, backward
// 2 per layer (Megatron's). Parameter names and global shapes stay
// Hugging Face's, so state dicts and
// exports read as the plain model's. Throws ArgumentError (before any
// collective) naming the config value when n_head or n_kv_head does not
// divide by the tp size, or when the mesh has no dim `tp_dim`.
#pragma once

#include <string>

#include "hp/mesh/device_mesh.h"
#include "hp/nn/llama_config.h"
#include "hp/tp/sharding_plan.h"

namespace hp {

ShardingPlan llama_tensor_parallel_plan(const nn::LlamaConfig& config, const DeviceMesh& mesh,
                                        const std::string& tp_dim = "tp");

}  // namespace hp
