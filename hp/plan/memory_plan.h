// A per-rank memory plan (P2 in docs/features.md): the peak of libtorch
// CPU memory that one training step of a GPT or a Llama will reach on each
// rank, as hp::memory_stats() counts it, predicted before training and
// split into terms.
//
// Nothing is allocated and nothing is communicated: the plan replays one
// step of hp-train's recipe (each block a fully_shard unit, then the root;
// cross-entropy; backward; clip_grad_norm_; AdamW) as a timeline of the
// tensors that step allocates and frees, computed from the shapes alone,
// and reports what is live at the timeline's highest point. So it works for
// a model that would not fit. docs/design.md ("Memory plan") says which
// tensors the timeline holds and where the peak falls.
//
// The step planned is the steady state (AdamW's moments already exist, the
// previous step's gradients are live when the step starts); the first step
// (no moments until the optimizer creates them, no forward prefetch before
// the execution order is recorded) is planned too, and the plan's peak is
// the higher of the two, which is what hp-train's memory table reports.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <variant>
#include <vector>

#include "hp/nn/gpt_config.h"
#include "hp/nn/llama_config.h"
#include "hp/plan/parallel_layout.h"

namespace hp::plan {

// Activation checkpointing: none, or every block recomputes its forward in
// backward and keeps only its input meanwhile.
enum class Checkpointing { kNone, kBlocks };

struct PlanOptions {
  // The model hp-train builds: the step's blocks, root and tensor-parallel
  // layout follow from which config this holds.
  std::variant<nn::GPTConfig, nn::LlamaConfig> model;
  // The mesh, fully_shard's reshard policy and dtypes (hp/plan/parallel_layout.h).
  ParallelLayout layout;
  int64_t rank = 0;            // global rank (uneven shards differ by rank)
  int64_t batch_per_rank = 1;  // samples this rank's forward takes
  int64_t seq = 1;             // tokens per sample
  bool comm_fusion = true;
  bool prefetch = true;
  Checkpointing checkpointing = Checkpointing::kNone;
  bool grad_clip = true;  // hp::clip_grad_norm_ before the optimizer step
};

// The terms of a prediction, in the order they are printed.
enum class Term {
  kParameters,     // shards (or whole parameters) plus the gathered working set
  kGradients,      // full gradients autograd produced, reduced gradient shards
  kOptimizer,      // AdamW's moments and its step's temporaries
  kActivations,    // the batch, tensors saved for backward, their gradients, logits
  kCommunication,  // fused packing buffers, gather and reduce-scatter buffers in flight
  kSlack,          // short-lived kernel temporaries (gradient clipping's fp64 copy)
};
constexpr int kTermCount = 6;
// "parameters", "gradients", "optimizer", "activations", "communication", "slack".
const char* term_name(Term term);

struct Breakdown {
  std::array<int64_t, kTermCount> bytes{};
  int64_t total() const;
  int64_t operator[](Term term) const { return bytes[static_cast<int>(term)]; }
};

struct StepPeak {
  Breakdown terms;    // what is live at the step's highest point
  std::string where;  // e.g. "loss backward (log_softmax)", "backward of h.1"
  // The part of `terms` (communication) that only reduce-scatters in flight
  // hold: their inputs and receive buffers, which the backend frees when it
  // completes them. The plan keeps them until the code waits (the highest
  // a step can reach); a step whose collectives finished sooner peaks up to
  // this much lower.
  int64_t in_flight_bytes = 0;
};

struct MemoryPlan {
  int64_t rank = 0;
  StepPeak steady;      // a step after the first
  StepPeak first_step;  // step 0
  // Bytes live between steps in the steady state: parameters, gradients,
  // AdamW's moments, persistent communication buffers.
  int64_t between_steps_bytes = 0;
  int64_t peak_bytes() const;  // the higher of the two steps
  const StepPeak& peak() const;
};

// Throws hp::ArgumentError naming the option when the options do not
// describe a run (a mesh that does not fit the mode, heads or key/value
// heads not divisible by the tp size, a non-positive batch, ...).
MemoryPlan plan_memory(const PlanOptions& options);

// A readable table: one row per term (MiB) for the steady step and the
// first step, with where each peak falls.
std::string format_plan(const MemoryPlan& plan);

}  // namespace hp::plan
