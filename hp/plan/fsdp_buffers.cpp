// fully_shard's buffers in the simulated step (docs/design.md, "The life of
// a parameter"): shards, gathers and their prefetch, reshard after
// forward, gradient reductions and what .grad holds after them.
#include "hp/plan/step_simulator.h"

#include <algorithm>
#include <iterator>
#include <utility>

#include <fmt/format.h>

namespace hp::plan::detail {

int64_t StepSimulator::unit_sum(const Unit& u,
                                const std::function<int64_t(const ParamShape&)>& f) const {
  int64_t sum = 0;
  for (const auto& p : u.params) sum += f(p);
  return sum;
}

// --- the state between steps ---
void StepSimulator::between_steps() {
  if (built_) return;
  built_ = true;
  for (Unit& u : units_) {
    for (const auto& p : u.params)
      params_.push_back(t_.alloc(Term::kParameters, held_numel(p) * s_.model_dtype_size));
    // bf16 with fusion and zero-copy: the shards' cast lives beside them.
    if (fused_gather() && s_.compute_dtype_size != s_.model_dtype_size) {
      flat_casts_.push_back(
          t_.alloc(Term::kCommunication, unit_held_numel(u) * s_.compute_dtype_size));
    }
  }
  if (first_) return;
  for (Unit& u : units_) {
    for (const auto& p : u.params) {
      adam_.push_back(t_.alloc(Term::kOptimizer, 2 * local_numel(p) * s_.model_dtype_size));
    }
    allocate_reduced_grads(u);
  }
}

// What .grad holds after a synchronised backward (steady state: the
// previous step's, live when the next starts).
void StepSimulator::allocate_reduced_grads(Unit& u) {
  if (!s_.fsdp) {
    for (const auto& p : u.params)
      u.grads.push_back(t_.alloc(Term::kGradients, full_numel(p) * s_.model_dtype_size));
    return;
  }
  if (s_.reduce_dtype_size !=
      s_.model_dtype_size) {  // cast to the parameter's dtype, unpadded pieces
    for (const auto& p : u.params)
      u.grads.push_back(t_.alloc(Term::kGradients, local_numel(p) * s_.model_dtype_size));
    return;
  }
  if (s_.options.comm_fusion) {  // aliases of one reduced buffer
    u.flat_grads = t_.alloc(Term::kGradients, unit_held_numel(u) * s_.reduce_dtype_size);
    return;
  }
  for (const auto& p : u.params)
    u.grads.push_back(t_.alloc(Term::kGradients, held_numel(p) * s_.reduce_dtype_size));
}

void StepSimulator::zero_grad() {
  for (Unit& u : units_) {
    t_.free_all(u.grads);
    t_.free(u.flat_grads);
  }
}

// --- gathering (fully_shard's pre-forward and pre-backward) ---
int64_t StepSimulator::unsharded_bytes(const Unit& u) const {
  return unit_sum(u, [&](const ParamShape& p) { return p.unsharded(s_.shards); }) *
         s_.compute_dtype_size;
}

// Gloo's own buffers for one gather: a fused all_gather_coalesced packs
// the inputs into one flat tensor and receives into one flat output
// (shards x inputs); a per-parameter all_gather receives into one flat
// output; a cast for compute (bf16) copies the shard first.
int64_t StepSimulator::gather_temps(const Unit& u, int64_t ranks, bool from_pieces) const {
  const int64_t in_total = unit_sum(u, [&](const ParamShape& p) {
    return p.unsharded(s_.shards) / (from_pieces ? ranks : s_.shards);
  });
  if (fused_gather()) return (in_total + ranks * in_total) * s_.compute_dtype_size;
  int64_t casts = 0, largest = 0;
  for (const auto& p : u.params) {
    const int64_t in = p.unsharded(s_.shards) / (from_pieces ? ranks : s_.shards);
    if (s_.compute_dtype_size != s_.model_dtype_size && !from_pieces)
      casts += in * s_.compute_dtype_size;
    largest = std::max(largest, ranks * in * s_.compute_dtype_size);
  }
  return casts + largest;
}

// `prefetch`: issued ahead, waited for only when the unit runs; Gloo's
// buffers of that gather may live through this unit's compute.
void StepSimulator::issue_gather(Unit& u, bool prefetch) {
  if (!needs_unshard() || u.gathered) return;
  u.gathered = true;
  if (!sharded()) {  // a cast for compute: no collective
    for (const auto& p : u.params)
      u.unsharded.push_back(t_.alloc(Term::kParameters, p.numel() * s_.compute_dtype_size));
    return;
  }
  if (fused_gather()) {
    u.unsharded.push_back(t_.alloc(Term::kParameters, unsharded_bytes(u)));
  } else {
    for (const auto& p : u.params)
      u.unsharded.push_back(
          t_.alloc(Term::kParameters, p.unsharded(s_.shards) * s_.compute_dtype_size));
  }
  const bool from_pieces = !u.pieces.empty();
  const int64_t ranks = from_pieces ? s_.ranks_after_forward : s_.shards;
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
void StepSimulator::finish_gather(Unit& u) {
  t_.free(u.gather_temps);
  t_.free_all(u.pieces);
}

void StepSimulator::free_unsharded(Unit& u) {
  t_.free_all(u.unsharded);
  u.gathered = false;
}

void StepSimulator::pre_forward(size_t index) {
  Unit& u = units_[index];
  t_.at(fmt::format("forward of {}", u.name));
  issue_gather(u);
  finish_gather(u);
  // Implicit prefetch needs the order recorded by the first forward.
  if (s_.options.prefetch && !first_ && index + 1 < units_.size()) {
    issue_gather(units_[index + 1], /*prefetch=*/true);
  }
}

void StepSimulator::post_forward(size_t index) {
  Unit& u = units_[index];
  if (!needs_unshard() || u.is_root) return;
  // The blocks are units 1.. in forward order; the last keeps its parameters.
  const int64_t blocks = static_cast<int64_t>(units_.size()) - 1;
  const ReshardAfterForward setting =
      s_.options.layout.block_reshard_after_forward(static_cast<int64_t>(index) - 1, blocks);
  if (ranks_after_forward(setting, s_.shards) == 1) return;
  if (s_.ranks_after_forward > 1 && s_.ranks_after_forward < s_.shards) {
    for (const auto& p : u.params) {
      u.pieces.push_back(
          t_.alloc(Term::kParameters,
                   p.unsharded(s_.shards) / s_.ranks_after_forward * s_.compute_dtype_size));
    }
  }
  free_unsharded(u);
}

void StepSimulator::pre_backward(size_t index) {
  Unit& u = units_[index];
  t_.at(fmt::format("backward of {}", u.name));
  issue_gather(u);
  finish_gather(u);
  // The previous unit in forward order (the root has none before it).
  if (s_.options.prefetch && index >= 2) issue_gather(units_[index - 1], /*prefetch=*/true);
}

// --- gradients arriving (fully_shard's post-accumulate hook) ---
Reduction* StepSimulator::push_reduction(Reduction r) {
  // A low-precision reduce-scatter sums what it received in fp32 (the
  // pieces cast, then their sum) on the backend's thread, while the next
  // unit computes: counted from issue to completion.
  if (!r.scattered && s_.reduce_dtype_size != kFp32) {
    r.sum = t_.alloc(Term::kCommunication, (r.received + r.numel) * kFp32);
  }
  if (!r.scattered) {
    for (Id id : {r.input, r.scratch, r.sum}) t_.mark_in_flight(id);
  }
  reductions_.push_back(std::move(r));
  return &reductions_.back();
}

void StepSimulator::scatter_done(Reduction& r) {
  if (r.scattered) return;
  r.scattered = true;
  t_.free(r.input);
  t_.free(r.scratch);
  t_.free(r.sum);
}

void StepSimulator::assign(Reduction& r) {
  scatter_done(r);
  Unit& u = *r.unit;
  if (s_.reduce_dtype_size != s_.model_dtype_size) {
    std::vector<int> which = r.params;
    if (which.empty()) {
      for (size_t i = 0; i < u.params.size(); ++i) which.push_back(static_cast<int>(i));
    }
    for (int i : which)
      u.grads.push_back(t_.alloc(Term::kGradients, local_numel(u.params[i]) * s_.model_dtype_size));
    t_.free(r.output);
  } else {
    t_.retag(r.output, Term::kGradients);
    if (s_.options.comm_fusion) {
      u.flat_grads = r.output;
    } else {
      u.grads.push_back(r.output);
    }
    r.output = Timeline::kNone;
  }
}

// Moves every reduction one stage on (fused: the pipeline); `all`
// completes them.
void StepSimulator::advance_reductions(bool all) {
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

void StepSimulator::arrive(Unit& u, int param, Id grad) {
  const ParamShape& p = u.params[param];
  if (!s_.fsdp) {  // .grad keeps autograd's gradient
    t_.retag(grad, Term::kGradients);
    u.grads.push_back(grad);
    return;
  }
  // take_grad: the reduce dtype.
  if (s_.reduce_dtype_size != s_.compute_dtype_size) {
    Id cast = t_.alloc(Term::kGradients, compute_numel(p) * s_.reduce_dtype_size);
    t_.free(grad);
    grad = cast;
  }
  const bool first_arrival = u.arrived++ == 0;
  const bool last = u.arrived == static_cast<int>(u.params.size());
  const int stages = s_.replicas > 1 ? 1 : 0;
  if (!s_.options.comm_fusion) {
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
        r.input = t_.alloc(Term::kCommunication, s_.shards * held * s_.reduce_dtype_size);
        t_.free(grad);
      }
      t_.retag(r.input, Term::kCommunication);
      // The parameter's unsharded buffer receives the reduce-scatter when
      // the dtypes match; otherwise it goes and the collective allocates.
      Id buffer = u.unsharded.empty() ? Timeline::kNone : u.unsharded[param];
      if (!u.unsharded.empty()) u.unsharded[param] = Timeline::kNone;
      if (buffer != Timeline::kNone && s_.reduce_dtype_size == s_.compute_dtype_size) {
        r.scratch = buffer;
        t_.retag(r.scratch, Term::kCommunication);
      } else {
        t_.free(buffer);
        r.scratch = t_.alloc(Term::kCommunication, s_.shards * held * s_.reduce_dtype_size);
      }
      r.output = t_.alloc(Term::kCommunication, held * s_.reduce_dtype_size);
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
  r.numel = unit_held_numel(u);
  r.input = u.packed;
  u.packed = Timeline::kNone;
  if (sharded()) {
    r.received = s_.shards * r.numel;
    Id buffer = u.unsharded.empty() ? Timeline::kNone : u.unsharded[0];
    u.unsharded.clear();
    if (buffer != Timeline::kNone && s_.reduce_dtype_size == s_.compute_dtype_size) {
      r.scratch = buffer;
      t_.retag(r.scratch, Term::kCommunication);
    } else {
      t_.free(buffer);
      r.scratch = t_.alloc(Term::kCommunication, r.received * s_.reduce_dtype_size);
    }
    r.output = t_.alloc(Term::kCommunication, r.numel * s_.reduce_dtype_size);
  } else {
    r.output = r.input;  // the replicate bucket, all-reduced in place
    r.input = Timeline::kNone;
    r.scattered = true;
    t_.free_all(u.unsharded);
  }
  u.gathered = false;
  push_reduction(std::move(r));
}

void StepSimulator::pack(Unit& u) {
  if (u.packed != Timeline::kNone) return;
  const int64_t numel = sharded() ? s_.shards * unit_held_numel(u)
                                  : unit_sum(u, [&](const ParamShape& p) { return p.numel(); });
  u.packed = t_.alloc(Term::kCommunication, numel * s_.reduce_dtype_size);
}

// A parameter gradient autograd produced.
void StepSimulator::param_grad(Unit& u, const char* name) {
  const int param = u.index_of(name);
  arrive(u, param,
         t_.alloc(Term::kGradients, compute_numel(u.params[param]) * s_.compute_dtype_size));
}

// What is left of a unit after its backward (fully_shard reshards).
void StepSimulator::finish_unit(Unit& u) {
  if (!s_.fsdp) return;
  if (s_.options.comm_fusion || sharded()) {
    // Every buffer went to a reduction or is freed here.
    t_.free_all(u.unsharded);
    u.gathered = false;
  }
}

}  // namespace hp::plan::detail
