// One simulated training step of the memory plan (P2): hp-train's recipe
// replayed on a Timeline from the shapes alone. Internal to hp/plan; the
// members are defined by concept: step_simulator.cpp (the step, the root,
// attention), fsdp_buffers.cpp (fully_shard's gathers and reductions),
// gpt_activations.cpp, llama_activations.cpp, optimizer_step.cpp.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include "hp/plan/memory_plan.h"
#include "hp/plan/parameter_table.h"
#include "hp/plan/step_setup.h"
#include "hp/plan/timeline.h"

namespace hp::plan::detail {

constexpr int64_t kInt64 = 8;
constexpr int64_t kFp64 = 8;
// What a checkpointed call keeps to replay randomness: the CPU generator's
// state as a byte tensor (docs/design.md, "Activation checkpointing").
constexpr int64_t kCpuGeneratorState = 5056;

// One fully_shard unit (or, without fully_shard, the plain parameters of
// that part of the model) during a simulated step.
struct Unit {
  std::string name;
  std::vector<ParamShape> params;
  bool is_root = false;
  // Per parameter: the buffers live now.
  std::vector<Id> unsharded;  // fused: one entry, the flat buffer
  std::vector<Id> pieces;     // reshard_after_forward = N
  std::vector<Id> grads;      // reduced gradient (or, without fully_shard, .grad)
  Id packed = Timeline::kNone;
  Id gather_temps = Timeline::kNone;  // Gloo's buffers of a prefetched gather
  Id flat_grads = Timeline::kNone;    // fused: the reduced gradients, one buffer
  std::vector<Id> deferred;
  int arrived = 0;
  bool gathered = false;  // the unsharded memory exists
  bool prefetched = false;

  // The parameter named `name` (within the unit) and its index in params.
  int index_of(const std::string& name) const;
  const ParamShape& param(const std::string& name) const { return params[index_of(name)]; }
};

struct Reduction {
  Id input = Timeline::kNone;
  Id scratch = Timeline::kNone;
  Id output = Timeline::kNone;
  Id sum = Timeline::kNone;  // a low-precision reduce-scatter sums in fp32
  int64_t numel = 0;         // reduced elements (output)
  int64_t received = 0;      // elements received (for a low-precision sum)
  Unit* unit = nullptr;
  std::vector<int> params;  // indexes into unit->params; empty: all of them
  bool scattered = false;   // the reduce-scatter has completed
  int stages_left = 1;      // HSDP/DDP: the all-reduce over replicas follows
};

// The gradients of attention's q, k and v (attention_backward).
struct AttentionGrads {
  Id dq, dk, dv;
};

// An RMSNorm's saved tensors (hp/nn/rms_norm.cpp): 1/rms per token, the
// normalised input; computing in bf16 it also keeps its input's fp32 copy.
struct NormActs {
  Id input32 = -1, rstd = -1, normed = -1;
};

// What a block's forward keeps for backward (docs/design.md, "Memory
// plan"), beside its input (the previous block's output).
struct BlockActs {
  // The GPT's LayerNorms: mean and rstd per token, and their outputs.
  Id norm1_stats = -1, norm1_out = -1, norm2_stats = -1, norm2_out = -1;
  // Attention: q, k, v as matmul takes them, the causal mask, the softmax
  // probabilities, the heads' output merged; then the residual after it.
  Id q = -1, k = -1, v = -1, mask = -1, probs = -1, attn_out = -1, residual = -1;
  // The MLP: the GPT's c_fc output; the input of the output projection
  // (gelu(c_fc) in the GPT, silu(gate) * up in the Llama).
  Id fc_out = -1, mlp_hidden = -1;
  // The Llama's besides: its norms, the rotary tables, the SwiGLU's
  // gate, silu(gate) and up, and the block's output (both models').
  NormActs norm1, norm2;
  Id cos = -1, sin = -1, gate = -1, silu = -1, up = -1, out = -1;
};

// The activations of one forward and backward, by part of the model, as the
// step's timeline has them: `saved`, what the part leaves live (negative in a
// backward, which frees), and `rise`, the most it is above its start meanwhile.
struct ActivationPart {
  int64_t saved = 0;
  int64_t rise = 0;
};
struct ActivationParts {
  ActivationPart embeddings, block, head;                     // forward (head: with the loss)
  ActivationPart head_backward, block_backward, embeddings_backward;
};

class StepSimulator {
 public:
  StepSimulator(const StepSetup& s, bool first_step);

  StepPeak run();

  int64_t between_steps_bytes();

  // One forward and backward of this setup's batch (mode none, or tp for
  // a tensor-parallel stage), its activations measured part by part, each
  // part's rise with tensor parallelism's all-reduce buffers: what the
  // pipeline's plan of a stage adds up (hp/plan/pipeline_plan.h).
  ActivationParts activation_parts();

 private:
  // Probing (activation_parts): the end of one part of the step.
  void mark();

  Id alloc_activation(int64_t bytes) { return t_.alloc(Term::kActivations, bytes); }

  // --- sizes ---
  bool sharded() const { return s_.fsdp && s_.shards > 1; }
  bool needs_unshard() const {
    return s_.fsdp && (sharded() || s_.compute_dtype_size != s_.model_dtype_size);
  }
  bool fused_gather() const { return s_.fsdp && s_.options.comm_fusion && sharded(); }
  // A parameter's shape here is this rank's before fully_shard (under
  // tensor parallelism, its local tensor); fully_shard then splits dim 0.
  int64_t held_numel(const ParamShape& p) const {  // what the parameter's storage holds
    return sharded() ? p.padded(s_.shards) : p.numel();
  }
  int64_t local_numel(const ParamShape& p) const {  // what the optimizer sees
    return sharded() ? p.local(s_.shards, s_.shard_rank) : p.numel();
  }
  int64_t compute_numel(const ParamShape& p) const {  // the gradient autograd produces
    return sharded() ? p.unsharded(s_.shards) : p.numel();
  }
  int64_t full_numel(const ParamShape& p) const { return p.numel(); }
  int64_t unit_sum(const Unit& u, const std::function<int64_t(const ParamShape&)>& f) const;
  int64_t unit_held_numel(const Unit& u) const {
    return unit_sum(u, [&](const ParamShape& p) { return held_numel(p); });
  }

  // --- the state between steps ---
  void between_steps();

  // What .grad holds after a synchronised backward (steady state: the
  // previous step's, live when the next starts).
  void allocate_reduced_grads(Unit& u);

  void zero_grad();

  // --- gathering (fully_shard's pre-forward and pre-backward) ---
  int64_t unsharded_bytes(const Unit& u) const;
  // Gloo's own buffers for one gather: a fused all_gather_coalesced packs
  // the inputs into one flat tensor and receives into one flat output
  // (shards x inputs); a per-parameter all_gather receives into one flat
  // output; a cast for compute (bf16) copies the shard first.
  int64_t gather_temps(const Unit& u, int64_t ranks, bool from_pieces) const;

  // `prefetch`: issued ahead, waited for only when the unit runs; Gloo's
  // buffers of that gather may live through this unit's compute.
  void issue_gather(Unit& u, bool prefetch = false);

  // Waiting for a unit's gather: its buffers and the pieces it regathered
  // from go.
  void finish_gather(Unit& u);

  void free_unsharded(Unit& u);

  void pre_forward(size_t index);

  void post_forward(size_t index);

  void pre_backward(size_t index);

  // --- forward ---

  int64_t scores_bytes() const {
    return s_.options.batch_per_rank * (s_.heads / s_.tp) * s_.options.seq * s_.options.seq *
           s_.compute_dtype_size;
  }
  int64_t hidden_bytes() const { return s_.tokens * s_.hidden * s_.compute_dtype_size; }
  // Column-parallel widths are split over the tp ranks.
  int64_t split_hidden_bytes() const { return hidden_bytes() / s_.tp; }

  BlockActs gpt_block_forward();

  // Attention from the projected q, k and v to its output y, in both
  // models: matmul's contiguous [B * heads, T, hd] copies of its operands
  // (under grouped-query attention k and v already are: the repeats), the
  // scores scaled, masked and softmaxed, then att @ v.
  void attention_forward(BlockActs& a);

  // Backward of the output projection (its parameters `output_projection`
  // in `u`, in the order autograd reaches them) and of attention_forward:
  // the gradients of q, k and v (of the kv heads, not their repeats).
  AttentionGrads attention_backward(BlockActs& a, Unit& u,
                                    std::initializer_list<const char*> output_projection);

  // Tensor parallelism: a row-parallel output's Partial sum is reduced into
  // a fresh tensor where the residual adds it.
  void tp_all_reduce(int64_t bytes);

  void free_block(BlockActs& a);

  // The head's rows on this rank: its vocabulary shard.
  int64_t local_vocab() const { return units_[0].param("lm_head.weight").dim0; }

  void forward_and_loss();

  void gpt_forward();

  BlockActs block_forward() { return s_.llama ? llama_block_forward() : gpt_block_forward(); }

  // Each block's forward from the previous output (outputs_.back()); a
  // Llama's under bf16 saves nothing that is its input (its norm keeps an
  // fp32 copy), so the input goes unless checkpointing keeps it.
  void blocks_forward();

  // A block's forward is done: checkpointing keeps only its input.
  void after_block_forward(size_t i, BlockActs& a);

  // --- the Llama (hp/nn/llama*.cpp, rms_norm.cpp, rotary.cpp) ---
  bool low_precision() const { return s_.compute_dtype_size != kFp32; }
  // Widths on this tp rank: query heads, key/value heads, the MLP.
  int64_t query_bytes() const {
    return s_.tokens * (s_.heads / s_.tp) * (s_.hidden / s_.heads) * s_.compute_dtype_size;
  }
  int64_t kv_bytes() const {
    return s_.tokens * (s_.kv_heads / s_.tp) * (s_.hidden / s_.heads) * s_.compute_dtype_size;
  }
  int64_t mlp_bytes() const {
    return s_.tokens * tp_piece(s_.intermediate, s_.tp, s_.tp_rank) * s_.compute_dtype_size;
  }

  // RMSNorm's forward of a [N, d] input; it computes in fp32 (a bf16 input
  // is copied up first and the result cast back). Returns its output.
  Id rms_forward(NormActs& n);

  // RMSNorm's backward from `dout` (freed): its weight's gradient, and the
  // gradient of its input (returned).
  Id rms_backward(NormActs& n, Id& dout, Unit& u, const char* weight);

  // apply_rotary(x, cos, sin) = x * cos + rotate_half(x) * sin; x replaced.
  void rotary_forward(Id& x, int64_t bytes);

  void rotary_backward(Id& g, int64_t bytes);

  // The rotary tables, computed per call in fp64 and cast to the compute
  // dtype; the products keep cos and sin for backward.
  void rotary_tables(BlockActs& a);

  // A decoder layer's forward from its input (the previous output); under
  // bf16 nothing it saves is that input (the norm keeps an fp32 copy), so
  // llama_forward frees it unless checkpointing keeps it.
  BlockActs llama_block_forward();

  void llama_forward();

  void llama_block_backward(size_t index, BlockActs& a, Id& grad_out);

  // The head's logits (fp32 under the root's output_dtype) into logits_.
  void root_head_forward();

  // The root's output (logits_) to the loss: cross-entropy's log_softmax.
  void loss_forward();

  // --- gradients arriving (fully_shard's post-accumulate hook) ---
  Reduction* push_reduction(Reduction r);

  void scatter_done(Reduction& r);

  void assign(Reduction& r);

  // Moves every reduction one stage on (fused: the pipeline); `all`
  // completes them.
  void advance_reductions(bool all);

  void arrive(Unit& u, int param, Id grad);

  void pack(Unit& u);

  // A parameter gradient autograd produced.
  void param_grad(Unit& u, const char* name);

  // --- backward ---
  // Gathers block `index` for its backward; checkpointed, the forward runs
  // again with autograd, and its output (returned) stays until the inner
  // backward through it is done.
  Id begin_block_backward(size_t index, BlockActs& a);

  // A residual's backward: the gradient through the branch `branch` and the
  // one around it `around` (both freed) added; returned.
  Id add_residual_grads(Id& branch, Id& around);

  // The residual: the gradient through the norm's branch `norm_grad` and
  // the one around it `around` (both freed) added into `grad_out`; the
  // block's backward is done.
  void end_block_backward(size_t index, Id& norm_grad, Id& around, Id recomputed, Id& grad_out);

  void gpt_block_backward(size_t index, BlockActs& a, Id& grad_out);

  // What is left of a unit after its backward (fully_shard reshards).
  void finish_unit(Unit& u);

  void backward();

  void clip();

  void optimizer_step();

  StepSetup s_;
  bool first_;
  bool built_ = false;
  Timeline t_;
  std::vector<Unit> units_;                                 // root, then the blocks
  std::vector<std::pair<size_t, size_t>> optimizer_order_;  // model->parameters(): (unit, index)
  std::vector<Id> params_, flat_casts_, adam_;
  std::deque<Reduction> reductions_;
  std::vector<Id> outputs_;  // embeddings' output, then each block's
  std::vector<BlockActs> acts_;
  std::vector<Id> rng_states_;  // checkpointed blocks: the CPU generator's state each
  Id batch_ = -1, arange_ = -1, lnf_mean_ = -1, lnf_out_ = -1, logprobs_ = -1, loss_ = -1;
  Id logits_ = -1;
  NormActs lnf_;  // the Llama's final RMSNorm
  bool probe_ = false;
  std::vector<std::pair<int64_t, int64_t>> marks_;  // (live activations, their high) at each mark
};

}  // namespace hp::plan::detail
