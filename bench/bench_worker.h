// The worker side of hp-bench: what one row runs in its own process(es),
// started by the driver as `hprun -n R hp-bench --worker ROW ...`.
#pragma once

#include <string>

#include "bench/bench_config.h"

namespace hp::bench {

// One of our GPT rows (single, ddp, fsdp, fsdp_fused, fsdp_fused_prefetch,
// hsdp_fused_prefetch): warm-up steps, then config.steps timed steps; rank 0
// prints kResultMarker + JSON. Returns the exit status.
int run_gpt_worker(const std::string& row, const BenchConfig& config);

// One of our pipeline rows (pp4, pp4_gpipe, pp4_interleaved,
// pp4_zero_bubble; bench/pipeline_worker.cpp): a GPT of config.pp_layers
// blocks trained by hp::pp::Pipeline over the world; rank 0 prints
// kResultMarker + JSON with the per-rank, per-step compute and step times of
// the measured bubble. Returns the exit status.
int run_pipeline_worker(const std::string& row, const BenchConfig& config);

// The hook overhead: a stack of config.hook_units tiny hookable blocks,
// plain vs fully_shard on a world of one, forward + backward.
int run_hook_worker(const BenchConfig& config);

// The DTensor op dispatch's cost per op on tiny tensors (bench/dispatch_overhead.cpp).
int run_dispatch_worker(const BenchConfig& config);

// The checkpoint row: save and load of a config.ckpt_layers x config.ckpt_d
// GPT with AdamW state, sharded over the ranks, beside a plain write and
// read of the same bytes (checkpoint_worker.cpp).
int run_checkpoint_worker(const BenchConfig& config);

}  // namespace hp::bench
