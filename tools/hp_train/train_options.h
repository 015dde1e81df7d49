// hp-train's command line (A1): what the flags are, how they combine
// with the launcher's world, and every check made before a process group
// exists.
//
// Parsing, resolving the mode/mesh and validation are pure functions of the
// arguments and the world size, so every rank reaches the same verdict
// before any collective, and a bad flag ends the job on all ranks with the
// same message instead of hanging the others. Every error is an
// hp::ArgumentError naming the flag, the value and what was expected.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "hp/plan/parallel_layout.h"
#include "tools/hp_train/corpus.h"

namespace hp::train {

// --resume's value for "the newest checkpoint in --save-dir, if any".
inline constexpr const char* kResumeAuto = "auto";

// The defaults are the README's main job: FSDP on 2 ranks of a 2-core
// machine, one thread each, lowers the loss on fortunes from 5.58 (uniform
// over bytes) to about 2.4 in 2-3 minutes. Above lr 1e-3 the first steps
// spike (constant lr, no warm-up).
struct TrainOptions {
  // The model: "gpt" (hp/nn/gpt.h) or "llama" (hp/nn/llama.h), and its
  // shape; the vocabulary comes from the corpus.
  std::string model = "gpt";
  int64_t layers = 4;
  int64_t d = 128;
  int64_t heads = 4;
  int64_t ctx = 64;
  int64_t kv_heads = 0;  // --kv-heads, llama only: key/value heads; 0 = heads

  // Data: fortunes (bytes, vocab 256) unless data_file is set.
  std::string data_file;
  int64_t vocab = 0;  // 0: not given

  // Optimisation. batch is the GLOBAL batch: each of the D data-parallel
  // ranks takes batch / D samples.
  int64_t batch = 32;
  int64_t seq = 64;
  int64_t steps = 400;
  double lr = 1e-3;
  double weight_decay = 0.1;
  double grad_clip = 1.0;  // 0: no clipping
  uint64_t seed = 1337;

  // Parallelism. mode_given / mesh empty mean "the default" (see resolve).
  bool mode_given = false;
  plan::ParallelMode mode = plan::ParallelMode::kFSDP;
  std::string mesh;  // "N" or "RxS"

  // --init eager|meta (F17); empty: meta where it saves memory, i.e. in the
  // sharded modes (fsdp, hsdp, tp, fsdp_tp), eager otherwise (see
  // uses_meta_init).
  std::string init;
  // a .safetensors file of the full initial weights; under --init meta also
  // a checkpoint directory (--save-dir's, any world size)
  std::string init_from;
  std::string log_json;   // rank 0 appends one JSON object per step
  bool dry_run = false;   // --dry-run: print the memory plan (P2), train nothing

  // Checkpoints (tools/hp_train/checkpointing.h).
  std::string save_dir;    // --save-dir: sharded checkpoints go here
  int64_t save_every = 0;  // --save-every N (0: only at the end)
  bool save_async = false; // --save-async: write while training goes on (C7)
  // --resume DIR: continue from its newest checkpoint; kResumeAuto: from
  // --save-dir's newest, or from scratch when it holds none.
  std::string resume;
  std::string export_path; // --export FILE.safetensors: whole weights at the end

  // fully_shard's performance options (refused with --mode none). The
  // defaults are the fastest correct configuration: one all-gather and one
  // reduce-scatter per unit over flat buffers, the next unit gathered while
  // this one computes.
  bool comm_fusion = true;           // --no-comm-fusion clears it
  bool prefetch = true;              // --no-prefetch clears it
  ReshardAfterForward reshard_after_forward;  // --reshard-after-forward true|false|N
  plan::Dtype param_dtype = plan::Dtype::kFloat32;  // --param-dtype bf16|fp32
  std::optional<plan::Dtype> reduce_dtype;          // --reduce-dtype (default: the param dtype)
  std::string trace;                 // --trace FILE: Chrome trace per rank
  // The fully_shard flags given on the command line, as written (e.g.
  // "--no-comm-fusion"): --mode none refuses them rather than ignore them;
  // --mode tp with any of them builds fully_shard units over a data-parallel
  // dim of one rank to carry them (mixed precision, fusion).
  std::vector<std::string> fully_shard_flags;

  // Pipeline parallelism (hp/pp, docs/pipeline.md): --pp P ranks each run
  // their stages of the model; the schedule, its micro-batches per step (0:
  // twice the number of stages), its stages per rank (0: 1 for gpipe and
  // 1f1b, 2 for interleaved and zero-bubble) and the blocks that begin
  // stages 1, 2, ... (empty: balanced). Under --pp the world is the P
  // pipeline ranks (--mode none), D x P for D replicas of the pipeline
  // (--mode ddp) or D ranks sharding each stage (--mode fsdp), R x S x P
  // for each stage sharded over S ranks and replicated R times (--mode
  // hsdp --mesh RxSxP), P x T (--mode tp) or D x P x T (--mode fsdp_tp).
  int64_t pp = 1;
  std::string pp_schedule = "1f1b";
  int64_t microbatches = 0;
  int64_t pp_stages_per_rank = 0;
  std::vector<std::string> pp_split;

  // Activation checkpointing (hp/nn/activation_checkpoint.h): "blocks"
  // recomputes every block's forward in backward; any mode.
  std::string activation_checkpointing = "none";  // --activation-checkpointing none|blocks

  // Where the model computes: "cuda" (this local rank's GPU: LOCAL_RANK,
  // hp::dist::local_cuda_index) or "cpu"; empty: cuda when this libtorch
  // sees a GPU, else cpu (resolve_device_type).
  std::string device;
  // The card's dense bf16 peak in TFLOP/s for the MFU of the progress line;
  // 0: from the card's name (tools/hp_train/model_flops.h), no MFU for a card
  // not in its table.
  double peak_tflops = 0;

  int threads = 1;
  int64_t log_every = 20;
  int64_t sample_tokens = 200;  // 0: no sample
  double temperature = 0.8;
  int64_t top_k = 40;  // 0: sample from the whole vocabulary
};

struct CommandLine {
  bool help_requested = false;  // -h/--help: print help_text and exit 0
  std::string help_text;
  TrainOptions options;
};

// args excludes argv[0]. Checks each value on its own (types, ranges);
// combinations are checked by resolve_parallelism and validate_options.
CommandLine parse_command_line(const std::vector<std::string>& args);

// Where the job runs, as the launcher's environment says.
struct World {
  bool launched = false;  // RANK / WORLD_SIZE set by hprun, torchrun or mpirun
  int rank = 0;
  int size = 1;
};

// The mesh and mode after defaults, with fully_shard's reshard policy and
// dtypes (hp/plan/parallel_layout.h). The data-parallel size is the world
// size in the fully_shard modes (the mesh is row-major, so data-parallel
// rank = global rank), 1 under tensor parallelism (every rank sees the same
// samples) and D on fsdp_tp's DxT mesh (the T ranks of one data-parallel
// group see the same samples).
using Parallelism = plan::ParallelLayout;

// Defaults: --mode fsdp --mesh <world size> under a launcher, --mode none
// for a process started on its own (a process group needs a launcher's
// environment). fsdp takes a 1-D mesh N, hsdp a 2-D mesh RxS (replicas x
// shards, built as (replicate, shard)), ddp a 1-D mesh N (built as [N, 1]);
// the mesh's product must equal the world size; none runs in a world of one;
// tp takes a 1-D mesh T (tensor parallel over T ranks, one data-parallel
// copy); fsdp_tp a 2-D mesh DxT, built as (dp, tp).
Parallelism resolve_parallelism(const TrainOptions& options, const World& world);

// Combinations of flags: heads dividing d (an even head dim for llama),
// --kv-heads only with --model llama and dividing --heads, seq <= ctx, the global batch
// divisible by the data-parallel size, --vocab only with --data-file (and
// required by it), heads (and kv heads) dividing by the tensor-parallel size.
void validate_options(const TrainOptions& options, const Parallelism& parallelism);

// --device after its default: "cuda" when given or when this libtorch sees
// a GPU, else "cpu". "cuda" without a visible GPU raises ArgumentError
// naming what is missing.
std::string resolve_device_type(const TrainOptions& options);

// The pipeline schedule --pp, --pp-schedule, --microbatches and
// --pp-stages-per-rank give (after their defaults), checked (ArgumentError
// naming the flags). Only for options.pp > 1.
struct PipelineSchedule {
  std::string kind;  // --pp-schedule
  int64_t ranks = 1, stages_per_rank = 1, microbatches = 1;
  int64_t stages() const { return ranks * stages_per_rank; }
};
PipelineSchedule pipeline_schedule(const TrainOptions& options);

// Whether the model is built on the meta device and only the local shards
// are materialised (--init, default as above).
bool uses_meta_init(const TrainOptions& options, const Parallelism& parallelism);

// The corpus holds at least seq + 2 tokens (one full window and a target);
// token ids below --vocab are checked by load_token_file itself.
void validate_corpus(const TrainOptions& options, const Corpus& corpus);

}  // namespace hp::train
