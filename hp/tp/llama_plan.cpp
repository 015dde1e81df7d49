#include "hp/tp/llama_plan.h"

#include <algorithm>

#include "hp/util/error.h"

namespace hp {

ShardingPlan llama_tensor_parallel_plan(const nn::LlamaConfig& config, const DeviceMesh& mesh,
                                        const std::string& tp_dim) {
  const auto& names = mesh.dim_names();
  HP_CHECK_ARG(std::find(names.begin(), names.end(), tp_dim) != names.end(),
               "llama_tensor_parallel_plan: tp_dim '", tp_dim, "' is not a dim of ",
               mesh.describe(), "; expected one of ", to_string(names));
  const int64_t tp = mesh.size(tp_dim);
  HP_CHECK_ARG(config.n_head % tp == 0, "llama_tensor_parallel_plan: LlamaConfig.n_head ",
               config.n_head, " is not divisible by the tensor-parallel size ", tp,
               " (mesh dim '", tp_dim, "'); expected each rank to hold whole heads");
  HP_CHECK_ARG(config.n_kv_head % tp == 0, "llama_tensor_parallel_plan: LlamaConfig.n_kv_head ",
               config.n_kv_head, " is not divisible by the tensor-parallel size ", tp,
               " (mesh dim '", tp_dim, "'); expected each rank to hold whole key/value heads");
  const int64_t m = mesh.dim_index(tp_dim);
  auto on_tp = [&](const Placement& p) {
    Placements ps(mesh.ndim(), Replicate());
    ps[m] = p;
    return PlanLayout(ps);
  };
  const PlanLayout colwise = on_tp(Shard(0)), rowwise = on_tp(Shard(1));
  const PlanLayout replicate = on_tp(Replicate());
  ShardingPlan plan;
  plan.plan["model.embed_tokens.weight"] = on_tp(Shard(0));
  plan.plan["lm_head.weight"] = on_tp(Shard(0));
  plan.plan["model.norm.weight"] = replicate;
  for (int64_t i = 0; i < config.n_layer; ++i) {
    const std::string l = "model.layers." + std::to_string(i) + ".";
    for (const char* name : {"self_attn.q_proj.weight", "self_attn.k_proj.weight",
                             "self_attn.v_proj.weight", "mlp.gate_proj.weight",
                             "mlp.up_proj.weight"}) {
      plan.plan[l + name] = colwise;
    }
    plan.plan[l + "self_attn.o_proj.weight"] = rowwise;
    plan.plan[l + "mlp.down_proj.weight"] = rowwise;
    plan.plan[l + "input_layernorm.weight"] = replicate;
    plan.plan[l + "post_attention_layernorm.weight"] = replicate;
    // The rowwise outputs are Partial sums: reduced once here, so the
    // residual stream and the norms that read it are Replicate (left
    // Partial, each op of a norm would reduce it again).
    plan.output_plan["model.layers." + std::to_string(i) + ".self_attn.output"] = replicate;
    plan.output_plan["model.layers." + std::to_string(i) + ".mlp.output"] = replicate;
  }
  // The vocabulary-parallel lookup's Partial sum, reduced once on entry.
  plan.input_plan["model.layers.0.input"] = replicate;
  return plan;
}

}  // namespace hp
