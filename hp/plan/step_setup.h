// What the memory plan (P2) fixes for a run before simulating a step: the
// model's sizes, the layout's sizes on this rank and the element sizes of
// its dtypes. Internal to hp/plan.
#pragma once

#include <cstdint>

#include "hp/plan/memory_plan.h"

namespace hp::plan::detail {

constexpr int64_t kFp32 = 4;

// Everything fixed for a run: sizes, dtypes and the layout of the units.
struct StepSetup {
  PlanOptions options;
  int64_t shards = 1;    // fully_shard's shard group size
  int64_t replicas = 1;  // HSDP / DDP replicate size
  int64_t shard_rank = 0;
  int64_t tp = 1;        // tensor-parallel size
  int64_t tp_rank = 0;
  // Bytes per element: the model's own dtype (hp-train builds it in fp32),
  // the compute dtype and the gradient reduction dtype.
  int64_t model_dtype_size = kFp32;
  int64_t compute_dtype_size = kFp32;
  int64_t reduce_dtype_size = kFp32;
  int64_t tokens = 1;    // tokens this rank's forward takes
  int64_t ranks_after_forward = 0;  // ranks the blocks' parameters stay spread over after forward
  bool fsdp = false;     // fully_shard manages the parameters
  // The model's sizes, whichever config PlanOptions holds.
  bool llama = false;
  int64_t hidden = 1, heads = 1, kv_heads = 1, vocab = 1, context = 1, layers = 0;
  int64_t intermediate = 1;  // the Llama's MLP width
};

// Checks the options (hp::ArgumentError naming the option) and reads them.
StepSetup make_step_setup(const PlanOptions& options);

}  // namespace hp::plan::detail
