// hp-bench's configuration (A2): what every row of one run shares, and
// how the driver hands it to the worker processes it launches.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "hp/nn/gpt_config.h"

namespace hp::bench {

// The names of the standard rows and of the extras --rows also accepts, in
// the order of the row table (bench/rows.h, which says what each row is).
const std::vector<std::string>& row_names();
const std::vector<std::string>& extra_row_names();

// Workers print exactly one line starting with this (on rank 0), followed by
// a JSON object; the driver finds it among hprun's "[rank r] " prefixed lines.
constexpr const char* kResultMarker = "HPBENCH_RESULT ";

struct BenchConfig {
  // Model (GPT-2 shape) and data.
  int64_t vocab = 512;
  int64_t seq = 128;
  int64_t d = 256;
  int64_t heads = 4;
  int64_t layers = 4;
  int64_t ctx = 128;
  int64_t batch = 8;  // per rank
  // The configuration the activation-checkpointing target is stated for
  // (fsdp_ac against fsdp): 8 layers of width 256, 32 x 128 tokens per rank
  // on 2 ranks: hp-bench --rows fsdp,fsdp_ac --layers 8 --batch 32.
  // AdamW.
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double weight_decay = 0.1;
  uint64_t seed = 1337;
  // The pipeline rows (pp4, ... and their torch_ twins): a GPT of pp_layers
  // blocks (8: interleaved schedules over 4 ranks need 8 stages of at least
  // one block each), the shared batch of `batch` samples cut into
  // pp_microbatches micro-batches (batch a multiple of it).
  int64_t pp_layers = 8;
  int64_t pp_microbatches = 8;
  // How the pipeline rows cut the GPT into stages: "even" gives every stage
  // the same number of blocks (earlier stages one more where it does not
  // divide), so the stages cost about the same, as the schedules' bubble
  // formulas assume (the embeddings and the head of this GPT cost a fraction
  // of a block); "balanced" is hp::pp::plan_stages's default, which counts
  // the embeddings and the head as a block each, as torchtitan does for
  // large vocabularies.
  std::string pp_split = "even";
  // Timing. steps / warmup are per worker process (one round of one row).
  int64_t steps = 10;
  int64_t warmup = 3;
  // Processes.
  int ranks = 2;
  int hsdp_ranks = 2;
  // Raw little-endian uint16 token file, written by the driver.
  std::string tokens_path;
  // Hook overhead.
  int64_t hook_units = 64;
  int64_t hook_width = 16;
  int64_t hook_batch = 8;
  int64_t hook_steps = 400;
  // The checkpoint measurement (row "checkpoint"): a GPT of this depth and
  // width (14 x 768: ~100M parameters), saved and loaded in ckpt_dir.
  int64_t ckpt_layers = 14;
  int64_t ckpt_d = 768;
  std::string ckpt_dir = "/tmp";
  int ckpt_repeats = 2;
  // Where the rows compute: "cpu" (Gloo) or "cuda" (one GPU per local rank,
  // NCCL; hp-bench --device). The GPU rows are timed with CUDA events and
  // report the caching allocator's peaks.
  std::string device = "cpu";
  // Mixed precision of the fully_shard rows but ddp and of torch_fsdp2
  // (fp32 or bf16; reduce_dtype empty: the param dtype). single, ddp and
  // their PyTorch twins compute in fp32 (PyTorch's DDP has no public mixed
  // precision).
  std::string param_dtype = "fp32";
  std::string reduce_dtype;
  // --profile-ops: the directory where every GPT row's worker writes the
  // per-op profile of its timed steps (bench/op_compare.h); empty: none.
  std::string profile_ops_dir;

  // The GPT of this vocabulary, context and heads with `layers` blocks of
  // width `d` (the rows': layers, d; the checkpoint row's: ckpt_layers, ckpt_d).
  nn::GPTConfig gpt_config(int64_t layers, int64_t d) const;

  // Flags that reproduce this configuration on a worker's command line.
  std::vector<std::string> worker_args() const;
};

// The rows a --device cuda run takes by default: ours against PyTorch's,
// one of each kind (single, DDP, FSDP, HSDP).
const std::vector<std::string>& gpu_row_names();

// The 2-D mesh of the hsdp row for a world of `ranks` (2 or 4): [ranks/2, 2].
inline std::vector<int64_t> hsdp_mesh(int ranks) { return {ranks / 2, 2}; }

}  // namespace hp::bench
