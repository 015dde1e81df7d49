// The step as a whole: its order, the root (embeddings, head, loss) and
// the attention both models share (hp/plan/step_simulator.h).
#include "hp/plan/step_simulator.h"

#include <initializer_list>
#include <stdexcept>
#include <utility>

#include <fmt/format.h>

namespace hp::plan::detail {

int Unit::index_of(const std::string& param_name) const {
  for (size_t i = 0; i < params.size(); ++i) {
    if (params[i].name == param_name) return static_cast<int>(i);
  }
  throw std::logic_error(fmt::format("memory plan: unit {} has no parameter {}", name, param_name));
}

StepSimulator::StepSimulator(const StepSetup& s, bool first_step) : s_(s), first_(first_step) {
  ModelParameters model = model_parameters(s.options.model);
  if (s.tp > 1) apply_tensor_parallel_plan(model, s.tp, s.tp_rank);
  Unit root;
  root.name = "root";
  root.is_root = true;
  root.params = std::move(model.root);
  units_.push_back(std::move(root));
  for (size_t i = 0; i < model.blocks.size(); ++i) {
    Unit block;
    block.name = std::move(model.block_names[i]);
    block.params = std::move(model.blocks[i]);
    units_.push_back(std::move(block));
  }
  optimizer_order_ = std::move(model.order);
}

StepPeak StepSimulator::run() {
  between_steps();
  t_.at("start of the step");
  t_.start_peak();
  zero_grad();
  forward_and_loss();
  backward();
  clip();
  optimizer_step();
  return t_.peak();
}

int64_t StepSimulator::between_steps_bytes() {
  between_steps();
  return t_.live_total();
}

void StepSimulator::mark() {
  if (!probe_) return;
  marks_.emplace_back(t_.live_activations(), t_.activations_high());
  t_.start_activations_phase();
}

ActivationParts StepSimulator::activation_parts() {
  between_steps();
  probe_ = true;
  forward_and_loss();
  backward();
  probe_ = false;
  // Marks: the batch read, the embeddings, each block, the head and the
  // loss; then the head's backward, each block's, the embeddings'.
  const size_t layers = units_.size() - 1;
  auto part = [&](size_t end) {
    const auto& [start_live, start_high] = marks_.at(end - 1);
    (void)start_high;
    return ActivationPart{marks_.at(end).first - start_live, marks_.at(end).second - start_live};
  };
  ActivationParts parts;
  parts.embeddings = part(1);
  parts.block = part(2);
  parts.head = part(layers + 2);
  parts.head_backward = part(layers + 3);
  parts.block_backward = part(layers + 4);
  parts.embeddings_backward = part(2 * layers + 4);
  return parts;
}

// Attention from the projected q, k and v to its output y, in both
// models: matmul's contiguous [B * heads, T, hd] copies of its operands
// (under grouped-query attention k and v already are: the repeats), the
// scores scaled, masked and softmaxed, then att @ v.
void StepSimulator::attention_forward(BlockActs& a) {
  const bool gqa = s_.kv_heads != s_.heads;
  const int64_t seq = s_.options.seq;
  a.q = alloc_activation(query_bytes());
  if (!gqa) a.k = alloc_activation(query_bytes());
  Id scores = alloc_activation(scores_bytes());  // the product, then scaled
  Id scaled = alloc_activation(scores_bytes());
  t_.free(scores);
  Id ones = alloc_activation(seq * seq);
  a.mask = alloc_activation(seq * seq);
  t_.free(ones);
  Id masked = alloc_activation(scores_bytes());
  a.probs = alloc_activation(scores_bytes());
  t_.free(masked);
  t_.free(scaled);
  if (!gqa) a.v = alloc_activation(query_bytes());
  Id o = alloc_activation(query_bytes());
  a.attn_out = alloc_activation(query_bytes());
  t_.free(o);
}

// Backward of attention_forward from the gradient of its output `dout`
// (freed): the gradients of q, k and v (of the kv heads, not their repeats).
AttentionGrads StepSimulator::attention_backward(
    BlockActs& a, Unit& u, std::initializer_list<const char*> output_projection) {
  const bool gqa = s_.kv_heads != s_.heads;
  // The output projection, then heads back to [B, heads, T, hd]: a copy.
  Id dy = alloc_activation(query_bytes());
  for (const char* name : output_projection) param_grad(u, name);
  t_.free(a.attn_out);
  Id dout = alloc_activation(query_bytes());
  t_.free(dy);
  // att @ v
  Id dp = alloc_activation(scores_bytes());
  Id dv_heads = alloc_activation(query_bytes());
  t_.free(a.v);
  t_.free(dout);
  if (gqa) {  // the repeat's gradient: summed over each group
    Id summed = alloc_activation(kv_bytes());
    t_.free(dv_heads);
    dv_heads = summed;
  }
  Id dv = alloc_activation(kv_bytes());
  t_.free(dv_heads);
  // softmax, mask, scale
  Id ds = alloc_activation(scores_bytes());
  t_.free(a.probs);
  t_.free(dp);
  Id dm = alloc_activation(scores_bytes());
  t_.free(ds);
  t_.free(a.mask);
  Id dsc = alloc_activation(scores_bytes());
  t_.free(dm);
  // q @ k^T
  Id dq_heads = alloc_activation(query_bytes());
  Id dk_heads = alloc_activation(query_bytes());
  t_.free(a.q);
  t_.free(a.k);
  t_.free(dsc);
  Id dq = alloc_activation(query_bytes());
  t_.free(dq_heads);
  if (gqa) {
    Id summed = alloc_activation(kv_bytes());
    t_.free(dk_heads);
    dk_heads = summed;
  }
  Id dk = alloc_activation(kv_bytes());
  t_.free(dk_heads);
  return {dq, dk, dv};
}

// Tensor parallelism: a row-parallel output's Partial sum is reduced into
// a fresh tensor where the residual adds it.
void StepSimulator::tp_all_reduce(int64_t bytes) {
  if (s_.tp > 1) t_.spike(Term::kCommunication, bytes);
}

void StepSimulator::free_block(BlockActs& a) {
  for (Id* id : {&a.norm1_stats, &a.norm1_out, &a.q, &a.k, &a.v, &a.probs, &a.mask, &a.attn_out,
                 &a.residual, &a.norm2_stats, &a.norm2_out, &a.fc_out, &a.mlp_hidden,
                 &a.norm1.input32, &a.norm1.rstd, &a.norm1.normed, &a.norm2.input32,
                 &a.norm2.rstd, &a.norm2.normed, &a.cos, &a.sin, &a.gate, &a.silu, &a.up}) {
    t_.free(*id);
  }
}

void StepSimulator::forward_and_loss() {
  if (s_.llama) {
    llama_forward();
  } else {
    gpt_forward();
  }
  loss_forward();
  mark();
}

// Each block's forward from the previous output (outputs_.back()); a
// Llama's under bf16 saves nothing that is its input (its norm keeps an
// fp32 copy), so the input goes unless checkpointing keeps it.
void StepSimulator::blocks_forward() {
  const bool keeps_input =
      !s_.llama || !low_precision() || s_.options.checkpointing == Checkpointing::kBlocks;
  for (size_t i = 1; i < units_.size(); ++i) {
    pre_forward(i);
    BlockActs a = block_forward();
    if (!keeps_input) t_.free(outputs_.back());
    outputs_.push_back(a.out);
    a.out = Timeline::kNone;
    after_block_forward(i, a);
    mark();
  }
}

// A block's forward is done: checkpointing keeps only its input.
void StepSimulator::after_block_forward(size_t i, BlockActs& a) {
  if (s_.options.checkpointing == Checkpointing::kBlocks) {
    // Computed without autograd: nothing inside the block stays but the
    // generator's state for the recomputation; its input (the previous
    // output) is alive anyway.
    free_block(a);
    rng_states_.push_back(t_.alloc(Term::kActivations, kCpuGeneratorState));
  }
  acts_.push_back(a);
  post_forward(i);
}

// The head's logits (fp32 under the root's output_dtype) into logits_.
void StepSimulator::root_head_forward() {
  const int64_t vocab_shard = local_vocab();
  Id logits = alloc_activation(s_.tokens * vocab_shard * s_.compute_dtype_size);
  if (s_.compute_dtype_size != kFp32 && s_.fsdp) {  // the root's output_dtype: fp32 logits
    Id cast = alloc_activation(s_.tokens * vocab_shard * kFp32);
    t_.free(logits);
    logits = cast;
  }
  logits_ = logits;
}

// The root's output (logits_) to the loss: cross-entropy's log_softmax.
void StepSimulator::loss_forward() {
  const int64_t vocab_shard = local_vocab();
  Id logits = logits_;
  logits_ = Timeline::kNone;
  t_.at("loss (log_softmax)");
  logprobs_ = alloc_activation(s_.tokens * vocab_shard * kFp32);
  // Over vocabulary shards the rule computes the shifted logits and their
  // exponential before the result.
  if (s_.tp > 1) t_.spike(Term::kActivations, 2 * s_.tokens * vocab_shard * kFp32);
  t_.free(logits);
  loss_ = alloc_activation(kFp32);
}

// --- backward ---
// Gathers block `index` for its backward; checkpointed, the forward runs
// again with autograd, and its output (returned) stays until the inner
// backward through it is done.
Id StepSimulator::begin_block_backward(size_t index, BlockActs& a) {
  pre_backward(index);
  if (s_.options.checkpointing != Checkpointing::kBlocks) return Timeline::kNone;
  const std::string& name = units_[index].name;
  t_.at(fmt::format("backward of {} (recomputing its forward)", name));
  a = block_forward();
  const Id recomputed = a.out;
  a.out = Timeline::kNone;
  t_.at(fmt::format("backward of {}", name));
  return recomputed;
}

// The residual: the gradient through the norm's branch `norm_grad` and
// the one around it `around` (both freed) added into `grad_out`; the
// block's backward is done.
Id StepSimulator::add_residual_grads(Id& branch, Id& around) {
  Id sum = alloc_activation(hidden_bytes());
  t_.free(branch);
  t_.free(around);
  return sum;
}

void StepSimulator::end_block_backward(size_t index, Id& norm_grad, Id& around, Id recomputed,
                                       Id& grad_out) {
  grad_out = add_residual_grads(norm_grad, around);
  t_.free(recomputed);
  if (!rng_states_.empty()) t_.free(rng_states_[index - 1]);
  finish_unit(units_[index]);
}

void StepSimulator::backward() {
  const int64_t vocab_shard = local_vocab();
  Unit& root = units_[0];
  t_.at("loss backward (log_softmax)");
  Id dnll = alloc_activation(s_.tokens * vocab_shard * kFp32);
  Id dlogits = alloc_activation(s_.tokens * vocab_shard * kFp32);
  // Over vocabulary shards the rule computes grad - exp(output) * total:
  // the exponential and the product exist beside the result.
  if (s_.tp > 1) t_.spike(Term::kActivations, 2 * s_.tokens * vocab_shard * kFp32);
  t_.free(logprobs_);
  t_.free(dnll);
  t_.at("backward of root (lm_head)");
  if (s_.compute_dtype_size != kFp32 && s_.fsdp) {
    Id cast = alloc_activation(s_.tokens * vocab_shard * s_.compute_dtype_size);
    t_.free(dlogits);
    dlogits = cast;
  }
  Id dlnf = alloc_activation(hidden_bytes());
  param_grad(root, "lm_head.weight");
  t_.free(lnf_out_);
  t_.free(dlogits);
  Id dx = Timeline::kNone;
  if (s_.llama) {
    tp_all_reduce(hidden_bytes());
    dx = rms_backward(lnf_, dlnf, root, "model.norm.weight");
  } else {
    dx = alloc_activation(hidden_bytes());
    tp_all_reduce(hidden_bytes());
    param_grad(root, "ln_f.weight");
    param_grad(root, "ln_f.bias");
    t_.free(dlnf);
    t_.free(lnf_mean_);
  }
  t_.free(outputs_.back());
  mark();
  for (size_t i = units_.size() - 1; i >= 1; --i) {
    if (s_.llama) {
      llama_block_backward(i, acts_[i - 1], dx);
    } else {
      gpt_block_backward(i, acts_[i - 1], dx);
    }
    mark();
  }
  t_.at("backward of root (embeddings)");
  if (s_.llama) {
    param_grad(root, "model.embed_tokens.weight");
  } else {
    Id dpos = alloc_activation(s_.options.seq * s_.hidden * s_.compute_dtype_size);
    param_grad(root, "wpe.weight");
    t_.free(dpos);
    t_.free(arange_);
    param_grad(root, "wte.weight");
  }
  t_.free(dx);
  mark();
  t_.at("end of backward");
  if (s_.fsdp) {
    advance_reductions(/*all=*/true);
    for (Unit& u : units_) {
      finish_gather(u);
      t_.free_all(u.unsharded);
    }
  }
  t_.free(loss_);
  t_.free(batch_);
}

}  // namespace hp::plan::detail
