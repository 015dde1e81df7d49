// The Llama's activations op by op (hp/nn/llama*.cpp, rms_norm.cpp,
// rotary.cpp): what each forward op allocates and saves, and its backward.
#include "hp/plan/step_simulator.h"

namespace hp::plan::detail {

// RMSNorm's forward of a [N, d] input; it computes in fp32 (a bf16 input
// is copied up first and the result cast back). Returns its output.
Id StepSimulator::rms_forward(NormActs& n) {
  const int64_t n32 = s_.tokens * s_.hidden * kFp32, rows = s_.tokens * kFp32;
  if (low_precision()) n.input32 = alloc_activation(n32);  // saved by pow and the product
  Id squares = alloc_activation(n32);
  Id variance = alloc_activation(rows);
  t_.free(squares);
  Id shifted = alloc_activation(rows);
  n.rstd = alloc_activation(rows);
  Id normed = alloc_activation(n32);
  t_.free(shifted);
  if (low_precision()) {
    n.normed = alloc_activation(hidden_bytes());
    t_.free(normed);
  } else {
    n.normed = normed;
  }
  Id out = alloc_activation(hidden_bytes());
  t_.free(variance);
  return out;
}

// RMSNorm's backward from `dout` (freed): its weight's gradient, and the
// gradient of its input (returned).
Id StepSimulator::rms_backward(NormActs& n, Id& dout, Unit& u, const char* weight) {
  const int64_t n32 = s_.tokens * s_.hidden * kFp32, rows = s_.tokens * kFp32;
  t_.spike(Term::kActivations, hidden_bytes());  // dout * normed, summed over tokens
  param_grad(u, weight);
  Id dnormed = alloc_activation(hidden_bytes());
  t_.free(dout);
  t_.free(n.normed);
  if (low_precision()) {
    Id up = alloc_activation(n32);
    t_.free(dnormed);
    dnormed = up;
  }
  Id dh1 = alloc_activation(n32);
  t_.spike(Term::kActivations, n32);  // dnormed * input, summed over the row
  Id drstd = alloc_activation(rows);
  t_.free(dnormed);
  Id dshifted = alloc_activation(rows);
  t_.free(drstd);
  t_.free(n.rstd);
  Id dsquares = alloc_activation(n32);
  t_.free(dshifted);
  Id twice = alloc_activation(n32);
  Id dh2 = alloc_activation(n32);
  t_.free(twice);
  t_.free(dsquares);
  t_.free(n.input32);
  Id dh = alloc_activation(n32);
  t_.free(dh1);
  t_.free(dh2);
  if (low_precision()) {
    Id down = alloc_activation(hidden_bytes());
    t_.free(dh);
    dh = down;
  }
  return dh;
}

// apply_rotary(x, cos, sin) = x * cos + rotate_half(x) * sin; x replaced.
void StepSimulator::rotary_forward(Id& x, int64_t bytes) {
  Id neg = alloc_activation(bytes / 2);
  Id rotated = alloc_activation(bytes);
  t_.free(neg);
  Id xc = alloc_activation(bytes);
  Id rs = alloc_activation(bytes);
  Id out = alloc_activation(bytes);
  t_.free(xc);
  t_.free(rs);
  t_.free(rotated);
  t_.free(x);
  x = out;
}

void StepSimulator::rotary_backward(Id& g, int64_t bytes) {
  Id dcos = alloc_activation(bytes);
  Id dsin = alloc_activation(bytes);
  t_.free(g);
  Id neg = alloc_activation(bytes / 2);
  Id half1 = alloc_activation(bytes);
  t_.free(neg);
  Id half2 = alloc_activation(bytes);
  t_.free(dsin);
  Id sum = alloc_activation(bytes);
  t_.free(dcos);
  t_.free(half1);
  t_.free(half2);
  g = sum;
}

// The rotary tables, computed per call in fp64 and cast to the compute
// dtype; the products keep cos and sin for backward.
void StepSimulator::rotary_tables(BlockActs& a) {
  const int64_t seq = s_.options.seq, head_dim = s_.hidden / s_.heads;
  std::vector<Id> temps;
  for (int i = 0; i < 3; ++i) temps.push_back(alloc_activation(head_dim / 2 * kFp64));
  Id inv_freq = alloc_activation(head_dim / 2 * kFp64);
  t_.free_all(temps);
  Id positions = alloc_activation(seq * kFp64);
  Id angles = alloc_activation(seq * head_dim / 2 * kFp64);
  t_.free(positions);
  Id both = alloc_activation(seq * head_dim * kFp64);
  Id cos64 = alloc_activation(seq * head_dim * kFp64);
  a.cos = alloc_activation(seq * head_dim * s_.compute_dtype_size);
  Id sin64 = alloc_activation(seq * head_dim * kFp64);
  a.sin = alloc_activation(seq * head_dim * s_.compute_dtype_size);
  for (Id* id : {&cos64, &sin64, &both, &angles, &inv_freq}) t_.free(*id);
}

// A decoder layer's forward from its input (the previous output); under
// bf16 nothing it saves is that input (the norm keeps an fp32 copy), so
// llama_forward frees it unless checkpointing keeps it.
BlockActs StepSimulator::llama_block_forward() {
  const bool gqa = s_.kv_heads != s_.heads;
  BlockActs a;
  a.norm1_out = rms_forward(a.norm1);
  Id q = alloc_activation(query_bytes());
  Id k = alloc_activation(kv_bytes());
  Id v = alloc_activation(kv_bytes());
  rotary_tables(a);
  rotary_forward(q, query_bytes());
  rotary_forward(k, kv_bytes());
  if (gqa) {  // each kv head repeated for its group: contiguous copies
    Id kr = alloc_activation(query_bytes());
    t_.free(k);
    a.k = kr;
    Id vr = alloc_activation(query_bytes());
    t_.free(v);
    a.v = vr;
  }
  attention_forward(a);
  Id z = alloc_activation(hidden_bytes());
  tp_all_reduce(hidden_bytes());
  t_.free(q);
  t_.free(k);
  t_.free(v);
  a.residual = alloc_activation(hidden_bytes());
  t_.free(z);
  a.norm2_out = rms_forward(a.norm2);
  if (low_precision()) t_.free(a.residual);  // the norm keeps its fp32 copy
  a.gate = alloc_activation(mlp_bytes());
  a.silu = alloc_activation(mlp_bytes());
  a.up = alloc_activation(mlp_bytes());
  a.mlp_hidden = alloc_activation(mlp_bytes());
  Id mlp = alloc_activation(hidden_bytes());
  tp_all_reduce(hidden_bytes());
  a.out = alloc_activation(hidden_bytes());
  t_.free(mlp);
  return a;
}

void StepSimulator::llama_forward() {
  t_.at("forward of root");
  batch_ = alloc_activation(2 * s_.tokens * kInt64);
  mark();
  pre_forward(0);
  Id x = alloc_activation(hidden_bytes());  // the embedding's rows
  tp_all_reduce(hidden_bytes());
  outputs_.push_back(x);
  mark();
  blocks_forward();
  t_.at("forward of root");
  lnf_out_ = rms_forward(lnf_);
  if (low_precision()) t_.free(outputs_.back());
  root_head_forward();
}

void StepSimulator::llama_block_backward(size_t index, BlockActs& a, Id& grad_out) {
  Unit& u = units_[index];
  const Id recomputed = begin_block_backward(index, a);
  // mlp.down_proj, then silu(gate) * up
  Id dg = alloc_activation(mlp_bytes());
  param_grad(u, "mlp.down_proj.weight");
  t_.free(a.mlp_hidden);
  Id dsilu = alloc_activation(mlp_bytes());
  Id dup = alloc_activation(mlp_bytes());
  t_.free(dg);
  t_.free(a.silu);
  t_.free(a.up);
  Id dx_up = alloc_activation(hidden_bytes());
  param_grad(u, "mlp.up_proj.weight");
  t_.free(dup);
  Id dgate = alloc_activation(mlp_bytes());
  t_.free(dsilu);
  t_.free(a.gate);
  Id dx_gate = alloc_activation(hidden_bytes());
  param_grad(u, "mlp.gate_proj.weight");
  t_.free(dgate);
  t_.free(a.norm2_out);
  Id da2 = alloc_activation(hidden_bytes());
  t_.free(dx_up);
  t_.free(dx_gate);
  tp_all_reduce(hidden_bytes());
  // post_attention_layernorm, then the residual's two gradients added
  Id dh_norm = rms_backward(a.norm2, da2, u, "post_attention_layernorm.weight");
  t_.free(a.residual);
  Id dh = add_residual_grads(dh_norm, grad_out);
  auto [dq, dk, dv] = attention_backward(a, u, {"self_attn.o_proj.weight"});
  rotary_backward(dk, kv_bytes());
  rotary_backward(dq, query_bytes());
  t_.free(a.cos);
  t_.free(a.sin);
  // v, k, q projections; their input gradients added
  Id dx_v = alloc_activation(hidden_bytes());
  param_grad(u, "self_attn.v_proj.weight");
  t_.free(dv);
  Id dx_k = alloc_activation(hidden_bytes());
  param_grad(u, "self_attn.k_proj.weight");
  t_.free(dk);
  Id dx_vk = alloc_activation(hidden_bytes());
  t_.free(dx_v);
  t_.free(dx_k);
  Id dx_q = alloc_activation(hidden_bytes());
  param_grad(u, "self_attn.q_proj.weight");
  t_.free(dq);
  t_.free(a.norm1_out);
  Id da1 = alloc_activation(hidden_bytes());
  t_.free(dx_vk);
  t_.free(dx_q);
  tp_all_reduce(hidden_bytes());
  // input_layernorm, then the residual
  Id dx_norm = rms_backward(a.norm1, da1, u, "input_layernorm.weight");
  t_.free(outputs_[index - 1]);  // this block's input
  end_block_backward(index, dx_norm, dh, recomputed, grad_out);
}

}  // namespace hp::plan::detail
