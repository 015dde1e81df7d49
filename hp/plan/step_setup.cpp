#include "hp/plan/step_setup.h"

#include <variant>

#include "hp/plan/parallel_layout.h"
#include "hp/util/error.h"

namespace hp::plan::detail {

namespace {

// The sizes the timeline reads, from whichever config the options hold.
void read_model(StepSetup& s) {
  if (const auto* gpt = std::get_if<nn::GPTConfig>(&s.options.model)) {
    gpt->validate();
    s.hidden = gpt->n_embd;
    s.heads = s.kv_heads = gpt->n_head;
    s.vocab = gpt->vocab_size;
    s.context = gpt->context;
    s.layers = gpt->n_layer;
    return;
  }
  const auto& llama = std::get<nn::LlamaConfig>(s.options.model);
  llama.validate();
  s.llama = true;
  s.hidden = llama.n_embd;
  s.heads = llama.n_head;
  s.kv_heads = llama.n_kv_head;
  s.vocab = llama.vocab_size;
  s.context = llama.context;
  s.layers = llama.n_layer;
  s.intermediate = llama.intermediate_size;
}

}  // namespace

StepSetup make_step_setup(const PlanOptions& o) {
  StepSetup s;
  s.options = o;
  read_model(s);
  HP_CHECK_ARG(o.batch_per_rank >= 1, "plan_memory: batch_per_rank ", o.batch_per_rank,
               " must be at least 1");
  HP_CHECK_ARG(o.seq >= 1 && o.seq <= s.context, "plan_memory: seq ", o.seq,
               " must be in [1, context ", s.context, "]");
  const ParallelLayout& layout = o.layout;
  s.tokens = o.batch_per_rank * o.seq;
  s.compute_dtype_size = element_size(layout.param_dtype);
  s.reduce_dtype_size = element_size(layout.effective_reduce_dtype());
  s.fsdp = layout.uses_fully_shard();
  if (!s.fsdp) {
    HP_CHECK_ARG(layout.param_dtype == Dtype::kFloat32, "plan_memory: mode ",
                 mode_name(layout.mode), " without fully_shard units computes in fp32");
    s.reduce_dtype_size = s.compute_dtype_size;
  }
  s.shards = layout.shard_size();
  s.replicas = layout.replicate_size();
  s.tp = layout.tp_size();
  HP_CHECK_ARG(s.heads % s.tp == 0, "plan_memory: n_head ", s.heads,
               " is not divisible by the tensor-parallel size ", s.tp);
  HP_CHECK_ARG(s.kv_heads % s.tp == 0, "plan_memory: n_kv_head ", s.kv_heads,
               " is not divisible by the tensor-parallel size ", s.tp);
  const int64_t world = layout.world_size();
  HP_CHECK_ARG(o.rank >= 0 && o.rank < world, "plan_memory: rank ", o.rank,
               " is outside the mesh's ", world, " ranks");
  s.shard_rank = layout.shard_rank(o.rank);
  s.tp_rank = layout.tp_rank(o.rank);
  if (s.fsdp) {
    s.ranks_after_forward = ranks_after_forward(layout.reshard_after_forward, s.shards);
    HP_CHECK_ARG(s.ranks_after_forward >= 1 && s.shards % s.ranks_after_forward == 0,
                 "plan_memory: reshard_after_forward ", describe(layout.reshard_after_forward),
                 " must divide the shard size ", s.shards);
  }
  return s;
}

}  // namespace hp::plan::detail
