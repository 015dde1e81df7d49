// The GPT's activations op by op (hp/nn/gpt.cpp, block.cpp): what each
// forward op allocates and saves, and what its backward allocates and frees.
#include "hp/plan/step_simulator.h"

namespace hp::plan::detail {

BlockActs StepSimulator::gpt_block_forward() {
  BlockActs a;
  a.norm1_stats = alloc_activation(2 * s_.tokens * s_.compute_dtype_size);
  a.norm1_out = alloc_activation(hidden_bytes());
  Id qkv = alloc_activation(3 * split_hidden_bytes());
  attention_forward(a);
  Id z = alloc_activation(hidden_bytes());
  tp_all_reduce(hidden_bytes());
  t_.free(qkv);
  a.residual = alloc_activation(hidden_bytes());
  t_.free(z);
  a.norm2_stats = alloc_activation(2 * s_.tokens * s_.compute_dtype_size);
  a.norm2_out = alloc_activation(hidden_bytes());
  a.fc_out = alloc_activation(4 * split_hidden_bytes());
  a.mlp_hidden = alloc_activation(4 * split_hidden_bytes());
  a.out = alloc_activation(hidden_bytes());
  return a;
}

void StepSimulator::gpt_forward() {
  const int64_t seq = s_.options.seq;
  t_.at("forward of root");
  batch_ = alloc_activation(2 * s_.tokens * kInt64);
  mark();
  pre_forward(0);
  // Embeddings: token rows plus position rows, added.
  Id tok = alloc_activation(hidden_bytes());
  arange_ = alloc_activation(seq * kInt64);
  Id pos = alloc_activation(seq * s_.hidden * s_.compute_dtype_size);
  Id x = alloc_activation(hidden_bytes());
  tp_all_reduce(hidden_bytes());
  t_.free(tok);
  t_.free(pos);
  outputs_.push_back(x);
  mark();
  blocks_forward();
  t_.at("forward of root");
  lnf_mean_ = alloc_activation(2 * s_.tokens * s_.compute_dtype_size);
  lnf_out_ = alloc_activation(hidden_bytes());
  root_head_forward();
}

void StepSimulator::gpt_block_backward(size_t index, BlockActs& a, Id& grad_out) {
  Unit& u = units_[index];
  const Id recomputed = begin_block_backward(index, a);
  // mlp.c_proj
  Id dg = alloc_activation(4 * split_hidden_bytes());
  param_grad(u, "mlp.c_proj.weight");
  param_grad(u, "mlp.c_proj.bias");
  t_.free(a.mlp_hidden);
  // gelu
  Id df = alloc_activation(4 * split_hidden_bytes());
  t_.free(a.fc_out);
  t_.free(dg);
  // mlp.c_fc
  Id da2 = alloc_activation(hidden_bytes());
  param_grad(u, "mlp.c_fc.weight");
  param_grad(u, "mlp.c_fc.bias");
  t_.free(a.norm2_out);
  t_.free(df);
  tp_all_reduce(hidden_bytes());
  // ln_2, then the residual's two gradients added
  Id dh_ln = alloc_activation(hidden_bytes());
  param_grad(u, "ln_2.weight");
  param_grad(u, "ln_2.bias");
  t_.free(a.residual);
  t_.free(a.norm2_stats);
  t_.free(da2);
  Id dh = add_residual_grads(dh_ln, grad_out);
  auto [dq, dk, dv] = attention_backward(a, u, {"attn.c_proj.weight", "attn.c_proj.bias"});
  // split: q, k, v gradients concatenated
  Id dqkv = alloc_activation(3 * split_hidden_bytes());
  t_.free(dq);
  t_.free(dk);
  t_.free(dv);
  // attn.c_attn
  Id da1 = alloc_activation(hidden_bytes());
  param_grad(u, "attn.c_attn.weight");
  param_grad(u, "attn.c_attn.bias");
  t_.free(a.norm1_out);
  t_.free(dqkv);
  tp_all_reduce(hidden_bytes());
  // ln_1, then the residual
  Id dx_ln = alloc_activation(hidden_bytes());
  param_grad(u, "ln_1.weight");
  param_grad(u, "ln_1.bias");
  t_.free(outputs_[index - 1]);  // this block's input
  t_.free(a.norm1_stats);
  t_.free(da1);
  end_block_backward(index, dx_ln, dh, recomputed, grad_out);
}

}  // namespace hp::plan::detail
