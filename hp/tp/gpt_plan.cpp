#include "hp/tp/gpt_plan.h"

#include <algorithm>

#include "hp/util/error.h"

namespace hp {

ShardingPlan gpt_tensor_parallel_plan(const nn::GPTConfig& config, const DeviceMesh& mesh,
                                      const std::string& tp_dim) {
  const auto& names = mesh.dim_names();
  HP_CHECK_ARG(std::find(names.begin(), names.end(), tp_dim) != names.end(),
               "gpt_tensor_parallel_plan: tp_dim '", tp_dim, "' is not a dim of ",
               mesh.describe(), "; expected one of ", to_string(names));
  const int64_t tp = mesh.size(tp_dim);
  HP_CHECK_ARG(config.n_head % tp == 0, "gpt_tensor_parallel_plan: n_head ", config.n_head,
               " is not divisible by the tensor-parallel size ", tp, " (mesh dim '", tp_dim,
               "'); expected each rank to hold whole heads");
  const int64_t m = mesh.dim_index(tp_dim);
  // One placement per mesh dim: `p` on the tp dim, Replicate elsewhere.
  auto on_tp = [&](const Placement& p) {
    Placements ps(mesh.ndim(), Replicate());
    ps[m] = p;
    return PlanLayout(ps);
  };
  ShardingPlan plan;
  plan.plan["wte.weight"] = on_tp(Shard(0));
  plan.plan["lm_head.weight"] = on_tp(Shard(0));
  for (int64_t i = 0; i < config.n_layer; ++i) {
    const std::string h = "h." + std::to_string(i) + ".";
    plan.plan[h + "attn.c_attn.weight"] = on_tp(StridedShard(0, 3));
    plan.plan[h + "attn.c_attn.bias"] = on_tp(StridedShard(0, 3));
    plan.plan[h + "attn.c_proj.weight"] = on_tp(Shard(1));
    plan.plan[h + "mlp.c_fc.weight"] = on_tp(Shard(0));
    plan.plan[h + "mlp.c_fc.bias"] = on_tp(Shard(0));
    plan.plan[h + "mlp.c_proj.weight"] = on_tp(Shard(1));
  }
  return plan;
}

}  // namespace hp
