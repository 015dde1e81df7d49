#include "hp/plan/memory_plan.h"

#include <algorithm>
#include <deque>
#include <functional>
#include <optional>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <variant>

#include <fmt/format.h>

#include "hp/util/error.h"

namespace hp::plan {

const char* term_name(Term term) {
  switch (term) {
    case Term::kParameters: return "parameters";
    case Term::kGradients: return "gradients";
    case Term::kOptimizer: return "optimizer";
    case Term::kActivations: return "activations";
    case Term::kCommunication: return "communication";
    case Term::kSlack: return "slack";
  }
  return "?";
}

int64_t Breakdown::total() const {
  int64_t sum = 0;
  for (int64_t b : bytes) sum += b;
  return sum;
}

int64_t MemoryPlan::peak_bytes() const { return peak().terms.total(); }

const StepPeak& MemoryPlan::peak() const {
  return first_step.terms.total() > steady.terms.total() ? first_step : steady;
}

namespace {

constexpr int64_t kInt64 = 8;
constexpr int64_t kFp32 = 4;
constexpr int64_t kFp64 = 8;
// What a checkpointed call keeps to replay randomness: the CPU generator's
// state as a byte tensor (docs/design.md, "Activation checkpointing").
constexpr int64_t kCpuGeneratorState = 5056;

// The live tensors of one simulated step, by term, and the highest total
// seen with what made it up.
class Timeline {
 public:
  using Id = int64_t;
  static constexpr Id kNone = -1;

  Id alloc(Term term, int64_t bytes) {
    if (bytes <= 0) return kNone;
    const Id id = next_++;
    blocks_[id] = {term, bytes};
    live_.bytes[static_cast<int>(term)] += bytes;
    const int64_t total = live_.total();
    if (total > peak_.terms.total()) peak_ = {live_, where_, in_flight_};
    return id;
  }
  void free(Id& id) {
    if (id == kNone) return;
    auto it = blocks_.find(id);
    if (it != blocks_.end()) {
      live_.bytes[static_cast<int>(it->second.first)] -= it->second.second;
      if (in_flight_ids_.erase(id)) in_flight_ -= it->second.second;
      blocks_.erase(it);
    }
    id = kNone;
  }
  // Memory that only a collective in flight holds: freed when the backend
  // completes it, which may be before the code waits for it.
  void mark_in_flight(Id id) {
    if (id == kNone || !in_flight_ids_.insert(id).second) return;
    in_flight_ += blocks_.at(id).second;
  }
  void free_all(std::vector<Id>& ids) {
    for (Id& id : ids) free(id);
    ids.clear();
  }
  // A tensor that exists only for the duration of one kernel.
  void spike(Term term, int64_t bytes) {
    Id id = alloc(term, bytes);
    free(id);
  }
  // The same memory, counted under another term from now on.
  void retag(Id id, Term term) {
    if (id == kNone) return;
    auto& block = blocks_.at(id);
    live_.bytes[static_cast<int>(block.first)] -= block.second;
    block.first = term;
    live_.bytes[static_cast<int>(term)] += block.second;
  }
  void at(std::string where) { where_ = std::move(where); }
  // The step starts: what is live now is the baseline of its peak.
  void start_peak() { peak_ = {live_, where_, in_flight_}; }
  const StepPeak& peak() const { return peak_; }
  int64_t live_total() const { return live_.total(); }

 private:
  std::unordered_map<Id, std::pair<Term, int64_t>> blocks_;
  Id next_ = 0;
  Breakdown live_;
  std::unordered_set<Id> in_flight_ids_;
  int64_t in_flight_ = 0;
  StepPeak peak_;
  std::string where_ = "start of the step";
};
using Id = Timeline::Id;

// One parameter: its full shape as [dim0, rest...] and, after sharding over
// `shards` ranks along dim 0, what this rank holds (docs/design.md, "The
// life of a parameter"): a zero-padded chunk of ceil(dim0 / shards) rows,
// of which the torch.chunk piece is the parameter (what AdamW's moments
// are shaped like), and an unsharded buffer of shards * chunk rows.
struct ParamShape {
  std::string name;
  int64_t dim0 = 0;
  int64_t rest = 1;  // product of the other dims

  int64_t numel() const { return dim0 * rest; }
  int64_t chunk(int64_t shards) const { return (dim0 + shards - 1) / shards; }
  int64_t padded(int64_t shards) const { return chunk(shards) * rest; }
  int64_t unsharded(int64_t shards) const { return shards * padded(shards); }
  int64_t local(int64_t shards, int64_t shard_rank) const {
    const int64_t c = chunk(shards);
    return std::min(c, std::max<int64_t>(0, dim0 - shard_rank * c)) * rest;
  }
};

// The GPT's parameters by unit: the root (embeddings, final norm, head),
// then each block, in named_parameters() order within a unit.
std::vector<ParamShape> root_params(const nn::GPTConfig& c) {
  const int64_t d = c.n_embd;
  return {{"wte.weight", c.vocab_size, d},
          {"wpe.weight", c.context, d},
          {"ln_f.weight", d, 1},
          {"ln_f.bias", d, 1},
          {"lm_head.weight", c.vocab_size, d}};
}

std::vector<ParamShape> block_params(const nn::GPTConfig& c) {
  const int64_t d = c.n_embd;
  return {{"ln_1.weight", d, 1},         {"ln_1.bias", d, 1},
          {"attn.c_attn.weight", 3 * d, d}, {"attn.c_attn.bias", 3 * d, 1},
          {"attn.c_proj.weight", d, d},  {"attn.c_proj.bias", d, 1},
          {"ln_2.weight", d, 1},         {"ln_2.bias", d, 1},
          {"mlp.c_fc.weight", 4 * d, d}, {"mlp.c_fc.bias", 4 * d, 1},
          {"mlp.c_proj.weight", d, 4 * d}, {"mlp.c_proj.bias", d, 1}};
}

// Indexes into block_params() / root_params().
enum BlockParam { kLn1W, kLn1B, kAttnW, kAttnB, kAProjW, kAProjB, kLn2W, kLn2B, kFcW, kFcB,
                  kMProjW, kMProjB };
enum RootParam { kWte, kWpe, kLnfW, kLnfB, kHead };

// The Llama's (hp/nn/llama.h): no biases, RMSNorm weights only.
std::vector<ParamShape> llama_root_params(const nn::LlamaConfig& c) {
  return {{"model.embed_tokens.weight", c.vocab_size, c.n_embd},
          {"model.norm.weight", c.n_embd, 1},
          {"lm_head.weight", c.vocab_size, c.n_embd}};
}

std::vector<ParamShape> llama_block_params(const nn::LlamaConfig& c) {
  const int64_t d = c.n_embd, hd = c.head_dim(), m = c.intermediate_size;
  return {{"self_attn.q_proj.weight", c.n_head * hd, d},
          {"self_attn.k_proj.weight", c.n_kv_head * hd, d},
          {"self_attn.v_proj.weight", c.n_kv_head * hd, d},
          {"self_attn.o_proj.weight", d, c.n_head * hd},
          {"mlp.gate_proj.weight", m, d},
          {"mlp.up_proj.weight", m, d},
          {"mlp.down_proj.weight", d, m},
          {"input_layernorm.weight", d, 1},
          {"post_attention_layernorm.weight", d, 1}};
}

enum LlamaBlockParam { kQ, kK, kV, kO, kGate, kUp, kDown, kInNorm, kPostNorm };
enum LlamaRootParam { kEmbed, kNorm, kLmHead };

// Everything fixed for a run: sizes, dtypes and the layout of the units.
struct Setup {
  PlanOptions o;
  int64_t shards = 1;    // fully_shard's shard group size
  int64_t replicas = 1;  // HSDP / DDP replicate size
  int64_t shard_rank = 0;
  int64_t tp = 1;        // tensor-parallel size
  int64_t tp_rank = 0;
  int64_t ep = kFp32;    // the model's own dtype (hp-train builds it in fp32)
  int64_t ec = kFp32;    // compute dtype
  int64_t er = kFp32;    // reduce dtype
  int64_t N = 1;         // tokens this rank's forward takes
  int64_t keep_over = 0; // ranks the parameters stay spread over after forward
  bool fsdp = false;     // fully_shard manages the parameters
  // The model's sizes, whichever config PlanOptions holds.
  bool llama = false;
  int64_t d = 1, heads = 1, kv_heads = 1, vocab = 1, context = 1, layers = 0;
  int64_t intermediate = 1;  // the Llama's MLP width
};

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
  Id flat_grads = Timeline::kNone;  // fused: the reduced gradients, one buffer
  std::vector<Id> deferred;
  int arrived = 0;
  bool gathered = false;  // the unsharded memory exists
  bool prefetched = false;
};

struct Reduction {
  Id input = Timeline::kNone;
  Id scratch = Timeline::kNone;
  Id output = Timeline::kNone;
  Id sum = Timeline::kNone;  // a low-precision reduce-scatter sums in fp32
  int64_t numel = 0;  // reduced elements (output)
  int64_t received = 0;  // elements received (for a low-precision sum)
  Unit* unit = nullptr;
  std::vector<int> params;  // indexes into unit->params; empty: all of them
  bool scattered = false;   // the reduce-scatter has completed
  int stages_left = 1;      // HSDP/DDP: the all-reduce over replicas follows
};

class StepSimulator {
 public:
  StepSimulator(const Setup& s, bool first_step) : s_(s), first_(first_step) {
    Unit root;
    root.name = "root";
    root.is_root = true;
    if (s.llama) {
      root.params = llama_root_params(std::get<nn::LlamaConfig>(s.o.model));
    } else {
      root.params = root_params(std::get<nn::GPTConfig>(s.o.model));
    }
    units_.push_back(root);
    for (int64_t i = 0; i < s.layers; ++i) {
      Unit block;
      if (s.llama) {
        block.name = fmt::format("layers.{}", i);
        block.params = llama_block_params(std::get<nn::LlamaConfig>(s.o.model));
      } else {
        block.name = fmt::format("h.{}", i);
        block.params = block_params(std::get<nn::GPTConfig>(s.o.model));
      }
      units_.push_back(block);
    }
    // Tensor parallelism first: fully_shard (if any) splits the local tensors.
    if (s.tp > 1) assign_tp_layout();
  }

  StepPeak run() {
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

  int64_t between_steps_bytes() {
    between_steps();
    return t_.live_total();
  }

 private:
  // --- sizes ---
  bool sharded() const { return s_.fsdp && s_.shards > 1; }
  bool needs_unshard() const { return s_.fsdp && (sharded() || s_.ec != s_.ep); }
  bool fused_gather() const { return s_.fsdp && s_.o.comm_fusion && sharded(); }
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
  int64_t unit_sum(const Unit& u, const std::function<int64_t(const ParamShape&)>& f) const {
    int64_t sum = 0;
    for (const auto& p : u.params) sum += f(p);
    return sum;
  }

  // The Megatron plan (hp/tp/gpt_plan.h): each parameter becomes its local
  // tensor on this tp rank. The embedding and the head are split by
  // vocabulary rows (torch.chunk), the QKV projection and c_fc by output
  // rows, both output projections by input columns (heads and the MLP's
  // width divide evenly); the rest is replicated. A mode that adds
  // fully_shard on top (over the data-parallel dim) shards these local
  // tensors' dim 0 as it does whole ones.
  void assign_tp_layout() {
    const int64_t T = s_.tp;
    if (s_.llama) return assign_llama_tp_layout();
    for (Unit& u : units_) {
      for (size_t i = 0; i < u.params.size(); ++i) {
        ParamShape& p = u.params[i];
        if (u.is_root) {
          if (i == kWte || i == kHead) {
            const int64_t c = p.chunk(T);
            p.dim0 = std::min(c, std::max<int64_t>(0, p.dim0 - s_.tp_rank * c));
          }
        } else if (i == kAttnW || i == kAttnB || i == kFcW || i == kFcB) {
          p.dim0 /= T;
        } else if (i == kAProjW || i == kMProjW) {
          p.rest /= T;
        }
      }
    }
  }

  // This tp rank's torch.chunk piece of `n` rows or columns.
  int64_t tp_piece(int64_t n) const {
    const int64_t c = (n + s_.tp - 1) / s_.tp;
    return std::min(c, std::max<int64_t>(0, n - s_.tp_rank * c));
  }

  // The Llama's plan (hp/tp/llama_plan.h): embedding and head by vocabulary
  // rows, q/k/v/gate/up by output rows, o/down by input columns; the norms
  // replicated. Heads and key/value heads divide evenly (make_setup checks).
  void assign_llama_tp_layout() {
    for (Unit& u : units_) {
      for (size_t i = 0; i < u.params.size(); ++i) {
        ParamShape& p = u.params[i];
        if (u.is_root) {
          if (i == kEmbed || i == kLmHead) p.dim0 = tp_piece(p.dim0);
        } else if (i == kQ || i == kK || i == kV || i == kGate || i == kUp) {
          p.dim0 = tp_piece(p.dim0);
        } else if (i == kO || i == kDown) {
          p.rest = tp_piece(p.rest);
        }
      }
    }
  }

  // --- the state between steps ---
  void between_steps() {
    if (built_) return;
    built_ = true;
    for (Unit& u : units_) {
      for (const auto& p : u.params) params_.push_back(t_.alloc(Term::kParameters, held_numel(p) * s_.ep));
      // bf16 with fusion and zero-copy: the shards' cast lives beside them.
      if (fused_gather() && s_.ec != s_.ep) {
        flat_casts_.push_back(t_.alloc(Term::kCommunication,
                                       unit_sum(u, [&](const ParamShape& p) { return held_numel(p); }) * s_.ec));
      }
    }
    if (first_) return;
    for (Unit& u : units_) {
      for (const auto& p : u.params) {
        adam_.push_back(t_.alloc(Term::kOptimizer, 2 * local_numel(p) * s_.ep));
      }
      allocate_reduced_grads(u);
    }
  }

  // What .grad holds after a synchronised backward (steady state: the
  // previous step's, live when the next starts).
  void allocate_reduced_grads(Unit& u) {
    if (!s_.fsdp) {
      for (const auto& p : u.params) u.grads.push_back(t_.alloc(Term::kGradients, full_numel(p) * s_.ep));
      return;
    }
    if (s_.er != s_.ep) {  // cast to the parameter's dtype, unpadded pieces
      for (const auto& p : u.params) u.grads.push_back(t_.alloc(Term::kGradients, local_numel(p) * s_.ep));
      return;
    }
    if (s_.o.comm_fusion) {  // aliases of one reduced buffer
      u.flat_grads = t_.alloc(Term::kGradients, unit_sum(u, [&](const ParamShape& p) { return held_numel(p); }) * s_.er);
      return;
    }
    for (const auto& p : u.params) u.grads.push_back(t_.alloc(Term::kGradients, held_numel(p) * s_.er));
  }

  void zero_grad() {
    for (Unit& u : units_) {
      t_.free_all(u.grads);
      t_.free(u.flat_grads);
    }
  }

  // --- gathering (fully_shard's pre-forward and pre-backward) ---
  int64_t unsharded_bytes(const Unit& u) const {
    return unit_sum(u, [&](const ParamShape& p) { return p.unsharded(s_.shards); }) * s_.ec;
  }
  // Gloo's own buffers for one gather: a fused all_gather_coalesced packs
  // the inputs into one flat tensor and receives into one flat output
  // (shards x inputs); a per-parameter all_gather receives into one flat
  // output; a cast for compute (bf16) copies the shard first.
  int64_t gather_temps(const Unit& u, int64_t ranks, bool from_pieces) const {
    const int64_t in_total =
        unit_sum(u, [&](const ParamShape& p) { return p.unsharded(s_.shards) / (from_pieces ? ranks : s_.shards); });
    if (fused_gather()) return (in_total + ranks * in_total) * s_.ec;
    int64_t casts = 0, largest = 0;
    for (const auto& p : u.params) {
      const int64_t in = p.unsharded(s_.shards) / (from_pieces ? ranks : s_.shards);
      if (s_.ec != s_.ep && !from_pieces) casts += in * s_.ec;
      largest = std::max(largest, ranks * in * s_.ec);
    }
    return casts + largest;
  }

  // `prefetch`: issued ahead, waited for only when the unit runs; Gloo's
  // buffers of that gather may live through this unit's compute.
  void issue_gather(Unit& u, bool prefetch = false) {
    if (!needs_unshard() || u.gathered) return;
    u.gathered = true;
    if (!sharded()) {  // a cast for compute: no collective
      for (const auto& p : u.params) u.unsharded.push_back(t_.alloc(Term::kParameters, p.numel() * s_.ec));
      return;
    }
    if (fused_gather()) {
      u.unsharded.push_back(t_.alloc(Term::kParameters, unsharded_bytes(u)));
    } else {
      for (const auto& p : u.params) u.unsharded.push_back(t_.alloc(Term::kParameters, p.unsharded(s_.shards) * s_.ec));
    }
    const bool from_pieces = !u.pieces.empty();
    const int64_t ranks = from_pieces ? s_.keep_over : s_.shards;
    const int64_t temps = gather_temps(u, ranks, from_pieces);
    if (prefetch) {
      u.gather_temps = t_.alloc(Term::kCommunication, temps);
      t_.mark_in_flight(u.gather_temps);
    } else {
      t_.spike(Term::kCommunication, temps);
    }
  }

  // Waiting for a unit's gather: its buffers and the pieces it regathered
  // from go.
  void finish_gather(Unit& u) {
    t_.free(u.gather_temps);
    t_.free_all(u.pieces);
  }

  void free_unsharded(Unit& u) {
    t_.free_all(u.unsharded);
    u.gathered = false;
  }

  void pre_forward(size_t index) {
    Unit& u = units_[index];
    t_.at(fmt::format("forward of {}", u.name));
    issue_gather(u);
    finish_gather(u);
    // Implicit prefetch needs the order recorded by the first forward.
    if (s_.o.prefetch && !first_ && index + 1 < units_.size()) {
      issue_gather(units_[index + 1], /*prefetch=*/true);
    }
  }

  void post_forward(size_t index) {
    Unit& u = units_[index];
    if (!needs_unshard() || u.is_root || s_.keep_over == 1) return;
    if (s_.keep_over > 1 && s_.keep_over < s_.shards) {
      for (const auto& p : u.params) {
        u.pieces.push_back(t_.alloc(Term::kParameters, p.unsharded(s_.shards) / s_.keep_over * s_.ec));
      }
    }
    free_unsharded(u);
  }

  void pre_backward(size_t index) {
    Unit& u = units_[index];
    t_.at(fmt::format("backward of {}", u.name));
    issue_gather(u);
    finish_gather(u);
    // The previous unit in forward order (the root has none before it).
    if (s_.o.prefetch && index >= 2) issue_gather(units_[index - 1], /*prefetch=*/true);
  }

  // --- forward ---
  // What a block's forward keeps for backward (docs/design.md, "Memory
  // plan"), beside its input (the previous block's output).
  // An RMSNorm's saved tensors (hp/nn/rms_norm.cpp): 1/rms per token, the
  // normalised input; computing in bf16 it also keeps its input's fp32 copy.
  struct NormActs {
    Id input32 = -1, rstd = -1, normed = -1;
  };
  struct BlockActs {
    Id mean1 = -1, a1 = -1, q = -1, k = -1, v = -1, p = -1, mask = -1, y = -1, h = -1, mean2 = -1,
       a2 = -1, f = -1, g = -1;
    // The Llama's besides: its norms, the rotary tables, the SwiGLU's
    // gate, silu(gate), up and their product, and the block's output.
    NormActs n1, n2;
    Id cos = -1, sin = -1, gate = -1, silu = -1, up = -1, out = -1;
  };

  int64_t att_bytes() const {
    return s_.o.batch_per_rank * (s_.heads / s_.tp) * s_.o.seq * s_.o.seq * s_.ec;
  }
  int64_t nd() const { return s_.N * s_.d * s_.ec; }
  // Column-parallel widths are split over the tp ranks.
  int64_t nd_split() const { return nd() / s_.tp; }

  BlockActs block_forward() {
    const int64_t T = s_.o.seq;
    BlockActs a;
    Term A = Term::kActivations;
    a.mean1 = t_.alloc(A, 2 * s_.N * s_.ec);
    a.a1 = t_.alloc(A, nd());
    Id qkv = t_.alloc(A, 3 * nd_split());
    a.q = t_.alloc(A, nd_split());
    a.k = t_.alloc(A, nd_split());
    Id scores = t_.alloc(A, att_bytes());   // the product, then scaled
    Id scaled = t_.alloc(A, att_bytes());
    t_.free(scores);
    Id ones = t_.alloc(A, T * T);
    a.mask = t_.alloc(A, T * T);
    t_.free(ones);
    Id masked = t_.alloc(A, att_bytes());
    a.p = t_.alloc(A, att_bytes());
    t_.free(masked);
    t_.free(scaled);
    a.v = t_.alloc(A, nd_split());
    Id o = t_.alloc(A, nd_split());
    a.y = t_.alloc(A, nd_split());
    t_.free(o);
    Id z = t_.alloc(A, nd());
    tp_all_reduce(nd());
    t_.free(qkv);
    a.h = t_.alloc(A, nd());
    t_.free(z);
    a.mean2 = t_.alloc(A, 2 * s_.N * s_.ec);
    a.a2 = t_.alloc(A, nd());
    a.f = t_.alloc(A, 4 * nd_split());
    a.g = t_.alloc(A, 4 * nd_split());
    return a;
  }

  // Tensor parallelism: a row-parallel output's Partial sum is reduced into
  // a fresh tensor where the residual adds it.
  void tp_all_reduce(int64_t bytes) {
    if (s_.tp > 1) t_.spike(Term::kCommunication, bytes);
  }

  void free_block(BlockActs& a) {
    for (Id* id : {&a.mean1, &a.a1, &a.q, &a.k, &a.v, &a.p, &a.mask, &a.y, &a.h, &a.mean2, &a.a2,
                   &a.f, &a.g, &a.n1.input32, &a.n1.rstd, &a.n1.normed, &a.n2.input32,
                   &a.n2.rstd, &a.n2.normed, &a.cos, &a.sin, &a.gate, &a.silu, &a.up}) {
      t_.free(*id);
    }
  }

  // The head's rows on this rank: its vocabulary shard.
  int head_index() const { return s_.llama ? static_cast<int>(kLmHead) : static_cast<int>(kHead); }
  int64_t local_vocab() const { return units_[0].params[head_index()].dim0; }

  void forward_and_loss() {
    if (s_.llama) {
      llama_forward();
    } else {
      gpt_forward();
    }
    loss_forward();
  }

  void gpt_forward() {
    const int64_t d = s_.d, T = s_.o.seq;
    Term A = Term::kActivations;
    t_.at("forward of root");
    batch_ = t_.alloc(A, 2 * s_.N * kInt64);
    pre_forward(0);
    // Embeddings: token rows plus position rows, added.
    Id tok = t_.alloc(A, nd());
    arange_ = t_.alloc(A, T * kInt64);
    Id pos = t_.alloc(A, T * d * s_.ec);
    Id x = t_.alloc(A, nd());
    tp_all_reduce(nd());
    t_.free(tok);
    t_.free(pos);
    outputs_.push_back(x);
    for (size_t i = 1; i < units_.size(); ++i) {
      pre_forward(i);
      BlockActs a = block_forward();
      outputs_.push_back(t_.alloc(A, nd()));
      after_block_forward(i, a);
    }
    t_.at("forward of root");
    lnf_mean_ = t_.alloc(A, 2 * s_.N * s_.ec);
    lnf_out_ = t_.alloc(A, nd());
    root_head_forward();
  }

  // A block's forward is done: checkpointing keeps only its input.
  void after_block_forward(size_t i, BlockActs& a) {
    if (s_.o.checkpointing == Checkpointing::kBlocks) {
      // Computed without autograd: nothing inside the block stays but the
      // generator's state for the recomputation; its input (the previous
      // output) is alive anyway.
      free_block(a);
      rng_states_.push_back(t_.alloc(Term::kActivations, kCpuGeneratorState));
    }
    acts_.push_back(a);
    post_forward(i);
  }

  // --- the Llama (hp/nn/llama*.cpp, rms_norm.cpp, rotary.cpp) ---
  bool low_precision() const { return s_.ec != kFp32; }
  // Widths on this tp rank: query heads, key/value heads, the MLP.
  int64_t nq() const { return s_.N * (s_.heads / s_.tp) * (s_.d / s_.heads) * s_.ec; }
  int64_t nkv() const { return s_.N * (s_.kv_heads / s_.tp) * (s_.d / s_.heads) * s_.ec; }
  int64_t nm() const { return s_.N * tp_piece(s_.intermediate) * s_.ec; }

  // RMSNorm's forward of a [N, d] input; it computes in fp32 (a bf16 input
  // is copied up first and the result cast back). Returns its output.
  Id rms_forward(NormActs& n) {
    Term A = Term::kActivations;
    const int64_t n32 = s_.N * s_.d * kFp32, rows = s_.N * kFp32;
    if (low_precision()) n.input32 = t_.alloc(A, n32);  // saved by pow and the product
    Id squares = t_.alloc(A, n32);
    Id variance = t_.alloc(A, rows);
    t_.free(squares);
    Id shifted = t_.alloc(A, rows);
    n.rstd = t_.alloc(A, rows);
    Id normed = t_.alloc(A, n32);
    t_.free(shifted);
    if (low_precision()) {
      n.normed = t_.alloc(A, nd());
      t_.free(normed);
    } else {
      n.normed = normed;
    }
    Id out = t_.alloc(A, nd());
    t_.free(variance);
    return out;
  }

  // RMSNorm's backward from `dout` (freed): its weight's gradient, and the
  // gradient of its input (returned).
  Id rms_backward(NormActs& n, Id& dout, Unit& u, int weight) {
    Term A = Term::kActivations;
    const int64_t n32 = s_.N * s_.d * kFp32, rows = s_.N * kFp32;
    t_.spike(A, nd());  // dout * normed, summed over tokens
    param_grad(u, weight);
    Id dnormed = t_.alloc(A, nd());
    t_.free(dout);
    t_.free(n.normed);
    if (low_precision()) {
      Id up = t_.alloc(A, n32);
      t_.free(dnormed);
      dnormed = up;
    }
    Id dh1 = t_.alloc(A, n32);
    t_.spike(A, n32);  // dnormed * input, summed over the row
    Id drstd = t_.alloc(A, rows);
    t_.free(dnormed);
    Id dshifted = t_.alloc(A, rows);
    t_.free(drstd);
    t_.free(n.rstd);
    Id dsquares = t_.alloc(A, n32);
    t_.free(dshifted);
    Id twice = t_.alloc(A, n32);
    Id dh2 = t_.alloc(A, n32);
    t_.free(twice);
    t_.free(dsquares);
    t_.free(n.input32);
    Id dh = t_.alloc(A, n32);
    t_.free(dh1);
    t_.free(dh2);
    if (low_precision()) {
      Id down = t_.alloc(A, nd());
      t_.free(dh);
      dh = down;
    }
    return dh;
  }

  // apply_rotary(x, cos, sin) = x * cos + rotate_half(x) * sin; x replaced.
  void rotary_forward(Id& x, int64_t bytes) {
    Term A = Term::kActivations;
    Id neg = t_.alloc(A, bytes / 2);
    Id rotated = t_.alloc(A, bytes);
    t_.free(neg);
    Id xc = t_.alloc(A, bytes);
    Id rs = t_.alloc(A, bytes);
    Id out = t_.alloc(A, bytes);
    t_.free(xc);
    t_.free(rs);
    t_.free(rotated);
    t_.free(x);
    x = out;
  }

  void rotary_backward(Id& g, int64_t bytes) {
    Term A = Term::kActivations;
    Id dcos = t_.alloc(A, bytes);
    Id dsin = t_.alloc(A, bytes);
    t_.free(g);
    Id neg = t_.alloc(A, bytes / 2);
    Id half1 = t_.alloc(A, bytes);
    t_.free(neg);
    Id half2 = t_.alloc(A, bytes);
    t_.free(dsin);
    Id sum = t_.alloc(A, bytes);
    t_.free(dcos);
    t_.free(half1);
    t_.free(half2);
    g = sum;
  }

  // The rotary tables, computed per call in fp64 and cast to the compute
  // dtype; the products keep cos and sin for backward.
  void rotary_tables(BlockActs& a) {
    Term A = Term::kActivations;
    const int64_t T = s_.o.seq, hd = s_.d / s_.heads;
    std::vector<Id> temps;
    for (int i = 0; i < 3; ++i) temps.push_back(t_.alloc(A, hd / 2 * kFp64));
    Id inv_freq = t_.alloc(A, hd / 2 * kFp64);
    t_.free_all(temps);
    Id positions = t_.alloc(A, T * kFp64);
    Id angles = t_.alloc(A, T * hd / 2 * kFp64);
    t_.free(positions);
    Id both = t_.alloc(A, T * hd * kFp64);
    Id cos64 = t_.alloc(A, T * hd * kFp64);
    a.cos = t_.alloc(A, T * hd * s_.ec);
    Id sin64 = t_.alloc(A, T * hd * kFp64);
    a.sin = t_.alloc(A, T * hd * s_.ec);
    for (Id* id : {&cos64, &sin64, &both, &angles, &inv_freq}) t_.free(*id);
  }

  // A decoder layer's forward from its input (the previous output); under
  // bf16 nothing it saves is that input (the norm keeps an fp32 copy), so
  // llama_forward frees it unless checkpointing keeps it.
  BlockActs llama_block_forward() {
    Term A = Term::kActivations;
    const bool gqa = s_.kv_heads != s_.heads;
    BlockActs a;
    a.a1 = rms_forward(a.n1);
    Id q = t_.alloc(A, nq());
    Id k = t_.alloc(A, nkv());
    Id v = t_.alloc(A, nkv());
    rotary_tables(a);
    rotary_forward(q, nq());
    rotary_forward(k, nkv());
    if (gqa) {  // each kv head repeated for its group: contiguous copies
      Id kr = t_.alloc(A, nq());
      t_.free(k);
      a.k = kr;
      Id vr = t_.alloc(A, nq());
      t_.free(v);
      a.v = vr;
    }
    // matmul's contiguous [B * heads, T, hd] copies of its operands.
    a.q = t_.alloc(A, nq());
    if (!gqa) a.k = t_.alloc(A, nq());
    Id scores = t_.alloc(A, att_bytes());
    Id scaled = t_.alloc(A, att_bytes());
    t_.free(scores);
    Id ones = t_.alloc(A, s_.o.seq * s_.o.seq);
    a.mask = t_.alloc(A, s_.o.seq * s_.o.seq);
    t_.free(ones);
    Id masked = t_.alloc(A, att_bytes());
    a.p = t_.alloc(A, att_bytes());
    t_.free(masked);
    t_.free(scaled);
    if (!gqa) a.v = t_.alloc(A, nq());
    Id o = t_.alloc(A, nq());
    a.y = t_.alloc(A, nq());
    t_.free(o);
    Id z = t_.alloc(A, nd());
    tp_all_reduce(nd());
    t_.free(q);
    t_.free(k);
    t_.free(v);
    a.h = t_.alloc(A, nd());
    t_.free(z);
    a.a2 = rms_forward(a.n2);
    if (low_precision()) t_.free(a.h);  // the norm keeps its fp32 copy
    a.gate = t_.alloc(A, nm());
    a.silu = t_.alloc(A, nm());
    a.up = t_.alloc(A, nm());
    a.g = t_.alloc(A, nm());
    Id mlp = t_.alloc(A, nd());
    tp_all_reduce(nd());
    a.out = t_.alloc(A, nd());
    t_.free(mlp);
    return a;
  }

  void llama_forward() {
    Term A = Term::kActivations;
    t_.at("forward of root");
    batch_ = t_.alloc(A, 2 * s_.N * kInt64);
    pre_forward(0);
    Id x = t_.alloc(A, nd());  // the embedding's rows
    tp_all_reduce(nd());
    outputs_.push_back(x);
    const bool keeps_input = !low_precision() || s_.o.checkpointing == Checkpointing::kBlocks;
    for (size_t i = 1; i < units_.size(); ++i) {
      pre_forward(i);
      BlockActs a = llama_block_forward();
      if (!keeps_input) t_.free(outputs_.back());
      outputs_.push_back(a.out);
      a.out = Timeline::kNone;
      after_block_forward(i, a);
    }
    t_.at("forward of root");
    lnf_out_ = rms_forward(lnf_);
    if (low_precision()) t_.free(outputs_.back());
    root_head_forward();
  }

  void llama_block_backward(size_t index, BlockActs& a, Id& grad_out) {
    Unit& u = units_[index];
    Term A = Term::kActivations;
    const bool gqa = s_.kv_heads != s_.heads;
    pre_backward(index);
    Id recomputed = Timeline::kNone;
    if (s_.o.checkpointing == Checkpointing::kBlocks) {
      t_.at(fmt::format("backward of {} (recomputing its forward)", u.name));
      a = llama_block_forward();
      recomputed = a.out;
      a.out = Timeline::kNone;
      t_.at(fmt::format("backward of {}", u.name));
    }
    // mlp.down_proj, then silu(gate) * up
    Id dg = t_.alloc(A, nm());
    param_grad(u, kDown);
    t_.free(a.g);
    Id dsilu = t_.alloc(A, nm());
    Id dup = t_.alloc(A, nm());
    t_.free(dg);
    t_.free(a.silu);
    t_.free(a.up);
    Id dx_up = t_.alloc(A, nd());
    param_grad(u, kUp);
    t_.free(dup);
    Id dgate = t_.alloc(A, nm());
    t_.free(dsilu);
    t_.free(a.gate);
    Id dx_gate = t_.alloc(A, nd());
    param_grad(u, kGate);
    t_.free(dgate);
    t_.free(a.a2);
    Id da2 = t_.alloc(A, nd());
    t_.free(dx_up);
    t_.free(dx_gate);
    tp_all_reduce(nd());
    // post_attention_layernorm, then the residual's two gradients added
    Id dh_norm = rms_backward(a.n2, da2, u, kPostNorm);
    t_.free(a.h);
    Id dh = t_.alloc(A, nd());
    t_.free(dh_norm);
    t_.free(grad_out);
    // o_proj, heads back to [B, heads, T, hd]
    Id dy = t_.alloc(A, nq());
    param_grad(u, kO);
    t_.free(a.y);
    Id dout = t_.alloc(A, nq());
    t_.free(dy);
    // att @ v
    Id dp = t_.alloc(A, att_bytes());
    Id dv_heads = t_.alloc(A, nq());
    t_.free(a.v);
    t_.free(dout);
    if (gqa) {  // the repeat's gradient: summed over each group
      Id summed = t_.alloc(A, nkv());
      t_.free(dv_heads);
      dv_heads = summed;
    }
    Id dv = t_.alloc(A, nkv());
    t_.free(dv_heads);
    // softmax, mask, scale
    Id ds = t_.alloc(A, att_bytes());
    t_.free(a.p);
    t_.free(dp);
    Id dm = t_.alloc(A, att_bytes());
    t_.free(ds);
    t_.free(a.mask);
    Id dsc = t_.alloc(A, att_bytes());
    t_.free(dm);
    // q @ k^T
    Id dq_heads = t_.alloc(A, nq());
    Id dk_heads = t_.alloc(A, nq());
    t_.free(a.q);
    t_.free(a.k);
    t_.free(dsc);
    Id dq = t_.alloc(A, nq());
    t_.free(dq_heads);
    if (gqa) {
      Id summed = t_.alloc(A, nkv());
      t_.free(dk_heads);
      dk_heads = summed;
    }
    Id dk = t_.alloc(A, nkv());
    t_.free(dk_heads);
    rotary_backward(dk, nkv());
    rotary_backward(dq, nq());
    t_.free(a.cos);
    t_.free(a.sin);
    // v, k, q projections; their input gradients added
    Id dx_v = t_.alloc(A, nd());
    param_grad(u, kV);
    t_.free(dv);
    Id dx_k = t_.alloc(A, nd());
    param_grad(u, kK);
    t_.free(dk);
    Id dx_vk = t_.alloc(A, nd());
    t_.free(dx_v);
    t_.free(dx_k);
    Id dx_q = t_.alloc(A, nd());
    param_grad(u, kQ);
    t_.free(dq);
    t_.free(a.a1);
    Id da1 = t_.alloc(A, nd());
    t_.free(dx_vk);
    t_.free(dx_q);
    tp_all_reduce(nd());
    // input_layernorm, then the residual
    Id dx_norm = rms_backward(a.n1, da1, u, kInNorm);
    t_.free(outputs_[index - 1]);  // this block's input
    Id dx = t_.alloc(A, nd());
    t_.free(dx_norm);
    t_.free(dh);
    grad_out = dx;
    t_.free(recomputed);
    if (!rng_states_.empty()) t_.free(rng_states_[index - 1]);
    finish_unit(u);
  }

  // The head's logits (fp32 under the root's output_dtype) into logits_.
  void root_head_forward() {
    const int64_t Vl = local_vocab();
    Term A = Term::kActivations;
    Id logits = t_.alloc(A, s_.N * Vl * s_.ec);
    if (s_.ec != kFp32 && s_.fsdp) {  // the root's output_dtype: fp32 logits
      Id cast = t_.alloc(A, s_.N * Vl * kFp32);
      t_.free(logits);
      logits = cast;
    }
    logits_ = logits;
  }

  // The root's output (logits_) to the loss: cross-entropy's log_softmax.
  void loss_forward() {
    const int64_t Vl = local_vocab();
    Term A = Term::kActivations;
    Id logits = logits_;
    logits_ = Timeline::kNone;
    t_.at("loss (log_softmax)");
    logprobs_ = t_.alloc(A, s_.N * Vl * kFp32);
    // Over vocabulary shards the rule computes the shifted logits and their
    // exponential before the result.
    if (s_.tp > 1) t_.spike(A, 2 * s_.N * Vl * kFp32);
    t_.free(logits);
    loss_ = t_.alloc(A, kFp32);
  }

  // --- gradients arriving (fully_shard's post-accumulate hook) ---
  Reduction* push_reduction(Reduction r) {
    // A low-precision reduce-scatter sums what it received in fp32 (the
    // pieces cast, then their sum) on the backend's thread, while the next
    // unit computes: counted from issue to completion.
    if (!r.scattered && s_.er != kFp32) {
      r.sum = t_.alloc(Term::kCommunication, (r.received + r.numel) * kFp32);
    }
    if (!r.scattered) {
      for (Id id : {r.input, r.scratch, r.sum}) t_.mark_in_flight(id);
    }
    reductions_.push_back(std::move(r));
    return &reductions_.back();
  }

  void scatter_done(Reduction& r) {
    if (r.scattered) return;
    r.scattered = true;
    t_.free(r.input);
    t_.free(r.scratch);
    t_.free(r.sum);
  }

  void assign(Reduction& r) {
    scatter_done(r);
    Unit& u = *r.unit;
    if (s_.er != s_.ep) {
      std::vector<int> which = r.params;
      if (which.empty()) {
        for (size_t i = 0; i < u.params.size(); ++i) which.push_back(static_cast<int>(i));
      }
      for (int i : which) u.grads.push_back(t_.alloc(Term::kGradients, local_numel(u.params[i]) * s_.ep));
      t_.free(r.output);
    } else {
      t_.retag(r.output, Term::kGradients);
      if (s_.o.comm_fusion) {
        u.flat_grads = r.output;
      } else {
        u.grads.push_back(r.output);
      }
      r.output = Timeline::kNone;
    }
  }

  // Moves every reduction one stage on (fused: the pipeline); `all`
  // completes them.
  void advance_reductions(bool all) {
    for (auto it = reductions_.begin(); it != reductions_.end();) {
      Reduction& r = *it;
      bool done = false;
      do {
        if (!r.scattered) {
          scatter_done(r);
        } else if (r.stages_left > 0) {
          --r.stages_left;  // the all-reduce over replicas, in place
        }
        if (r.scattered && r.stages_left == 0) {
          assign(r);
          done = true;
        }
      } while (all && !done);
      it = done ? reductions_.erase(it) : std::next(it);
    }
  }

  void arrive(Unit& u, int param, Id grad) {
    const ParamShape& p = u.params[param];
    if (!s_.fsdp) {  // .grad keeps autograd's gradient
      t_.retag(grad, Term::kGradients);
      u.grads.push_back(grad);
      return;
    }
    // take_grad: the reduce dtype.
    if (s_.er != s_.ec) {
      Id cast = t_.alloc(Term::kGradients, compute_numel(p) * s_.er);
      t_.free(grad);
      grad = cast;
    }
    const bool first_arrival = u.arrived++ == 0;
    const bool last = u.arrived == static_cast<int>(u.params.size());
    const int stages = s_.replicas > 1 ? 1 : 0;
    if (!s_.o.comm_fusion) {
      if (first_arrival) advance_reductions(/*all=*/true);  // complete_before(wave)
      Reduction r;
      r.unit = &u;
      r.params = {param};
      r.stages_left = stages;
      const int64_t held = held_numel(p);
      r.numel = held;
      if (sharded()) {
        r.received = s_.shards * held;
        if (p.dim0 % s_.shards == 0) {
          r.input = grad;
        } else {  // padded rows: packed into [shards, padded] first
          r.input = t_.alloc(Term::kCommunication, s_.shards * held * s_.er);
          t_.free(grad);
        }
        t_.retag(r.input, Term::kCommunication);
        // The parameter's unsharded buffer receives the reduce-scatter when
        // the dtypes match; otherwise it goes and the collective allocates.
        Id buffer = u.unsharded.empty() ? Timeline::kNone : u.unsharded[param];
        if (!u.unsharded.empty()) u.unsharded[param] = Timeline::kNone;
        if (buffer != Timeline::kNone && s_.er == s_.ec) {
          r.scratch = buffer;
          t_.retag(r.scratch, Term::kCommunication);
        } else {
          t_.free(buffer);
          r.scratch = t_.alloc(Term::kCommunication, s_.shards * held * s_.er);
        }
        r.output = t_.alloc(Term::kCommunication, held * s_.er);
      } else {
        r.output = grad;  // all-reduced in place
        t_.retag(r.output, Term::kCommunication);
        if (!u.unsharded.empty()) t_.free(u.unsharded[param]);
        r.scattered = true;
      }
      push_reduction(std::move(r));
      if (last) u.gathered = false;
      return;
    }
    // Fused: copied into the unit's packing buffer at once, except the
    // root's, which wait as they are until its last gradient (embeddings).
    if (u.is_root && units_.size() > 1) {
      t_.retag(grad, Term::kGradients);
      u.deferred.push_back(grad);
    } else {
      pack(u);
      t_.free(grad);
    }
    if (!last) return;
    advance_reductions(/*all=*/false);
    pack(u);
    t_.free_all(u.deferred);
    Reduction r;
    r.unit = &u;
    r.stages_left = stages;
    r.numel = unit_sum(u, [&](const ParamShape& q) { return held_numel(q); });
    r.input = u.packed;
    u.packed = Timeline::kNone;
    if (sharded()) {
      r.received = s_.shards * r.numel;
      Id buffer = u.unsharded.empty() ? Timeline::kNone : u.unsharded[0];
      u.unsharded.clear();
      if (buffer != Timeline::kNone && s_.er == s_.ec) {
        r.scratch = buffer;
        t_.retag(r.scratch, Term::kCommunication);
      } else {
        t_.free(buffer);
        r.scratch = t_.alloc(Term::kCommunication, r.received * s_.er);
      }
      r.output = t_.alloc(Term::kCommunication, r.numel * s_.er);
    } else {
      r.output = r.input;  // the replicate bucket, all-reduced in place
      r.input = Timeline::kNone;
      r.scattered = true;
      t_.free_all(u.unsharded);
    }
    u.gathered = false;
    push_reduction(std::move(r));
  }

  void pack(Unit& u) {
    if (u.packed != Timeline::kNone) return;
    const int64_t numel = sharded() ? s_.shards * unit_sum(u, [&](const ParamShape& p) { return held_numel(p); })
                                    : unit_sum(u, [&](const ParamShape& p) { return p.numel(); });
    u.packed = t_.alloc(Term::kCommunication, numel * s_.er);
  }

  // A parameter gradient autograd produced.
  void param_grad(Unit& u, int param) {
    arrive(u, param, t_.alloc(Term::kGradients, compute_numel(u.params[param]) * s_.ec));
  }

  // --- backward ---
  void block_backward(size_t index, BlockActs& a, Id& grad_out) {
    Unit& u = units_[index];
    Term A = Term::kActivations;
    pre_backward(index);
    // Checkpointed: the forward runs again with autograd, and its output
    // stays until the inner backward through it is done.
    Id recomputed = Timeline::kNone;
    if (s_.o.checkpointing == Checkpointing::kBlocks) {
      t_.at(fmt::format("backward of {} (recomputing its forward)", u.name));
      a = block_forward();
      recomputed = t_.alloc(A, nd());
      t_.at(fmt::format("backward of {}", u.name));
    }
    // mlp.c_proj
    Id dg = t_.alloc(A, 4 * nd_split());
    param_grad(u, kMProjW);
    param_grad(u, kMProjB);
    t_.free(a.g);
    // gelu
    Id df = t_.alloc(A, 4 * nd_split());
    t_.free(a.f);
    t_.free(dg);
    // mlp.c_fc
    Id da2 = t_.alloc(A, nd());
    param_grad(u, kFcW);
    param_grad(u, kFcB);
    t_.free(a.a2);
    t_.free(df);
    tp_all_reduce(nd());
    // ln_2, then the residual's two gradients added
    Id dh_ln = t_.alloc(A, nd());
    param_grad(u, kLn2W);
    param_grad(u, kLn2B);
    t_.free(a.h);
    t_.free(a.mean2);
    t_.free(da2);
    Id dh = t_.alloc(A, nd());
    t_.free(dh_ln);
    t_.free(grad_out);
    // attn.c_proj
    Id dy = t_.alloc(A, nd_split());
    param_grad(u, kAProjW);
    param_grad(u, kAProjB);
    t_.free(a.y);
    // heads back to [B, nh, T, hd]: a copy
    Id dout = t_.alloc(A, nd_split());
    t_.free(dy);
    // att @ v
    Id dp = t_.alloc(A, att_bytes());
    Id dv_heads = t_.alloc(A, nd_split());
    t_.free(a.v);
    t_.free(dout);
    Id dv = t_.alloc(A, nd_split());
    t_.free(dv_heads);
    // softmax, mask, scale
    Id ds = t_.alloc(A, att_bytes());
    t_.free(a.p);
    t_.free(dp);
    Id dm = t_.alloc(A, att_bytes());
    t_.free(ds);
    t_.free(a.mask);
    Id dsc = t_.alloc(A, att_bytes());
    t_.free(dm);
    // q @ k^T
    Id dq_heads = t_.alloc(A, nd_split());
    Id dk_heads = t_.alloc(A, nd_split());
    t_.free(a.q);
    t_.free(a.k);
    t_.free(dsc);
    Id dq = t_.alloc(A, nd_split());
    t_.free(dq_heads);
    Id dk = t_.alloc(A, nd_split());
    t_.free(dk_heads);
    // split: q, k, v gradients concatenated
    Id dqkv = t_.alloc(A, 3 * nd_split());
    t_.free(dq);
    t_.free(dk);
    t_.free(dv);
    // attn.c_attn
    Id da1 = t_.alloc(A, nd());
    param_grad(u, kAttnW);
    param_grad(u, kAttnB);
    t_.free(a.a1);
    t_.free(dqkv);
    tp_all_reduce(nd());
    // ln_1, then the residual
    Id dx_ln = t_.alloc(A, nd());
    param_grad(u, kLn1W);
    param_grad(u, kLn1B);
    t_.free(outputs_[index - 1]);  // this block's input
    t_.free(a.mean1);
    t_.free(da1);
    Id dx = t_.alloc(A, nd());
    t_.free(dx_ln);
    t_.free(dh);
    grad_out = dx;
    t_.free(recomputed);
    if (!rng_states_.empty()) t_.free(rng_states_[index - 1]);
    finish_unit(u);
  }

  // What is left of a unit after its backward (fully_shard reshards).
  void finish_unit(Unit& u) {
    if (!s_.fsdp) return;
    if (s_.o.comm_fusion || sharded()) {
      // Every buffer went to a reduction or is freed here.
      t_.free_all(u.unsharded);
      u.gathered = false;
    }
  }

  void backward() {
    const int64_t d = s_.d;
    const int64_t Vl = local_vocab();
    Term A = Term::kActivations;
    Unit& root = units_[0];
    t_.at("loss backward (log_softmax)");
    Id dnll = t_.alloc(A, s_.N * Vl * kFp32);
    Id dlogits = t_.alloc(A, s_.N * Vl * kFp32);
    // Over vocabulary shards the rule computes grad - exp(output) * total:
    // the exponential and the product exist beside the result.
    if (s_.tp > 1) t_.spike(A, 2 * s_.N * Vl * kFp32);
    t_.free(logprobs_);
    t_.free(dnll);
    t_.at("backward of root (lm_head)");
    if (s_.ec != kFp32 && s_.fsdp) {
      Id cast = t_.alloc(A, s_.N * Vl * s_.ec);
      t_.free(dlogits);
      dlogits = cast;
    }
    Id dlnf = t_.alloc(A, nd());
    param_grad(root, head_index());
    t_.free(lnf_out_);
    t_.free(dlogits);
    Id dx = Timeline::kNone;
    if (s_.llama) {
      tp_all_reduce(nd());
      dx = rms_backward(lnf_, dlnf, root, kNorm);
    } else {
      dx = t_.alloc(A, nd());
      tp_all_reduce(nd());
      param_grad(root, kLnfW);
      param_grad(root, kLnfB);
      t_.free(dlnf);
      t_.free(lnf_mean_);
    }
    t_.free(outputs_.back());
    for (size_t i = units_.size() - 1; i >= 1; --i) {
      if (s_.llama) {
        llama_block_backward(i, acts_[i - 1], dx);
      } else {
        block_backward(i, acts_[i - 1], dx);
      }
    }
    t_.at("backward of root (embeddings)");
    if (s_.llama) {
      param_grad(root, kEmbed);
    } else {
      Id dpos = t_.alloc(A, s_.o.seq * d * s_.ec);
      param_grad(root, kWpe);
      t_.free(dpos);
      t_.free(arange_);
      param_grad(root, kWte);
    }
    t_.free(dx);
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

  void clip() {
    if (!s_.o.grad_clip) return;
    t_.at("clip_grad_norm_");
    // Each gradient's norm is taken in fp64: a double copy of it (a
    // DTensor gradient's local piece).
    int64_t largest = 0;
    for (const Unit& u : units_) {
      for (const auto& p : u.params) largest = std::max(largest, local_numel(p));
    }
    t_.spike(Term::kSlack, largest * kFp64);
  }

  void optimizer_step() {
    t_.at("optimizer step");
    // AdamW, per parameter in model->parameters() order: the moments are
    // created on the first step; sqrt(exp_avg_sq) and its scaled copy are
    // the step's temporaries.
    std::vector<const ParamShape*> order;
    const std::vector<int> before = s_.llama ? std::vector<int>{kEmbed}
                                             : std::vector<int>{kWte, kWpe};
    const std::vector<int> after = s_.llama ? std::vector<int>{kNorm, kLmHead}
                                            : std::vector<int>{kLnfW, kLnfB, kHead};
    for (int i : before) order.push_back(&units_[0].params[i]);
    for (size_t i = 1; i < units_.size(); ++i) {
      for (const auto& p : units_[i].params) order.push_back(&p);
    }
    for (int i : after) order.push_back(&units_[0].params[i]);
    for (const ParamShape* p : order) {
      const int64_t bytes = local_numel(*p) * s_.ep;
      if (first_) adam_.push_back(t_.alloc(Term::kOptimizer, 2 * bytes));
      t_.spike(Term::kOptimizer, 2 * bytes);
    }
  }

  Setup s_;
  bool first_;
  bool built_ = false;
  Timeline t_;
  std::vector<Unit> units_;  // root, then the blocks
  std::vector<Id> params_, flat_casts_, adam_;
  std::deque<Reduction> reductions_;
  std::vector<Id> outputs_;  // embeddings' output, then each block's
  std::vector<BlockActs> acts_;
  std::vector<Id> rng_states_;  // checkpointed blocks: the CPU generator's state each
  Id batch_ = -1, arange_ = -1, lnf_mean_ = -1, lnf_out_ = -1, logprobs_ = -1, loss_ = -1;
  Id logits_ = -1;
  NormActs lnf_;  // the Llama's final RMSNorm
};

// The sizes the timeline reads, from whichever config the options hold.
void read_model(Setup& s) {
  if (const auto* gpt = std::get_if<nn::GPTConfig>(&s.o.model)) {
    gpt->validate();
    s.d = gpt->n_embd;
    s.heads = s.kv_heads = gpt->n_head;
    s.vocab = gpt->vocab_size;
    s.context = gpt->context;
    s.layers = gpt->n_layer;
    return;
  }
  const auto& llama = std::get<nn::LlamaConfig>(s.o.model);
  llama.validate();
  s.llama = true;
  s.d = llama.n_embd;
  s.heads = llama.n_head;
  s.kv_heads = llama.n_kv_head;
  s.vocab = llama.vocab_size;
  s.context = llama.context;
  s.layers = llama.n_layer;
  s.intermediate = llama.intermediate_size;
}

Setup make_setup(const PlanOptions& o) {
  Setup s;
  s.o = o;
  read_model(s);
  HP_CHECK_ARG(o.batch_per_rank >= 1, "plan_memory: batch_per_rank ", o.batch_per_rank,
               " must be at least 1");
  HP_CHECK_ARG(o.seq >= 1 && o.seq <= s.context, "plan_memory: seq ", o.seq,
               " must be in [1, context ", s.context, "]");
  const ParallelLayout& layout = o.layout;
  s.N = o.batch_per_rank * o.seq;
  s.ec = element_size(layout.param_dtype);
  s.er = element_size(layout.effective_reduce_dtype());
  s.fsdp = layout.uses_fully_shard();
  if (!s.fsdp) {
    HP_CHECK_ARG(layout.param_dtype == Dtype::kFloat32, "plan_memory: mode ",
                 mode_name(layout.mode), " without fully_shard units computes in fp32");
    s.er = s.ec;
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
    s.keep_over = ranks_after_forward(layout.reshard_after_forward, s.shards);
    HP_CHECK_ARG(s.keep_over >= 1 && s.shards % s.keep_over == 0,
                 "plan_memory: reshard_after_forward ", describe(layout.reshard_after_forward),
                 " must divide the shard size ", s.shards);
  }
  return s;
}

std::string mib(int64_t bytes) { return fmt::format("{:.2f}", static_cast<double>(bytes) / (1 << 20)); }

}  // namespace

MemoryPlan plan_memory(const PlanOptions& options) {
  const Setup setup = make_setup(options);
  MemoryPlan plan;
  plan.rank = options.rank;
  plan.steady = StepSimulator(setup, /*first_step=*/false).run();
  plan.first_step = StepSimulator(setup, /*first_step=*/true).run();
  plan.between_steps_bytes = StepSimulator(setup, false).between_steps_bytes();
  return plan;
}

std::string format_plan(const MemoryPlan& plan) {
  std::string out = fmt::format("memory plan of rank {} (MiB)\n", plan.rank);
  out += fmt::format("  {:<14} {:>12} {:>12}\n", "term", "steady step", "first step");
  for (int i = 0; i < kTermCount; ++i) {
    out += fmt::format("  {:<14} {:>12} {:>12}\n", term_name(static_cast<Term>(i)),
                       mib(plan.steady.terms.bytes[i]), mib(plan.first_step.terms.bytes[i]));
  }
  out += fmt::format("  {:<14} {:>12} {:>12}\n", "peak", mib(plan.steady.terms.total()),
                     mib(plan.first_step.terms.total()));
  out += fmt::format("  {:<14} {:>12} {:>12}\n", "  in flight", mib(plan.steady.in_flight_bytes),
                     mib(plan.first_step.in_flight_bytes));
  out += fmt::format("  steady step peaks at: {}\n  first step peaks at: {}\n", plan.steady.where,
                     plan.first_step.where);
  out += fmt::format("  between steps: {} MiB; predicted peak: {} MiB", mib(plan.between_steps_bytes),
                     mib(plan.peak_bytes()));
  return out;
}

}  // namespace hp::plan
