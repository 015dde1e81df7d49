// Applies hp-train's --mode to a freshly built model (tools/hp_train/model.h).
#pragma once

#include <optional>
#include <vector>

#include "hp/fsdp/fully_shard.h"
#include "tools/hp_train/model.h"
#include "tools/hp_train/train_options.h"

namespace hp::train {

// Collective (needs the process group) except for mode none, which leaves
// the model alone and returns nullopt. Mode tp shards every layer with
// the model's tensor-parallel plan (TrainModel::tensor_parallel_plan) and
// returns nullopt;
// with fully_shard flags given (mixed precision, fusion: the layout's
// tp_units) it goes on as fsdp_tp on a 1xT mesh. fsdp_tp builds the (dp, tp) mesh,
// shards every layer over "tp" and then makes the units below over "dp".
// Otherwise builds the mesh and makes
// every block a fully_shard unit, then the root (embeddings, final norm,
// head), inner-first as fully_shard requires; returns the root's handle.
// The mesh decides the mode: 1-D shards (FSDP), (replicate, shard) is HSDP,
// a shard dim of one is DDP.
// The layout's reshard policy (block_reshard_after_forward: the last block
// keeps its parameters) and dtypes and the options' --comm-fusion and
// --no-prefetch set every unit's options; with a low-precision param dtype
// the root returns fp32 logits.
// --activation-checkpointing blocks checkpoints every block, in every mode.
// The meshes are of options.device ("cuda": NCCL groups over this rank's
// GPU, to which fully_shard moves a module still on the host; empty or
// "cpu": Gloo); callers resolve --device's default first (main.cpp).
std::optional<FSDPModule> parallelize(TrainModel& model, const Parallelism& parallelism,
                                      const TrainOptions& options);

// The same for a GPT (hp-bench and the memory plan's probes build one).
std::optional<FSDPModule> parallelize(nn::GPT& model, const Parallelism& parallelism,
                                      const TrainOptions& options);

// Every unit parallelize made: the root, then each block.
std::vector<FSDPModule> fully_shard_units(TrainModel& model, const FSDPModule& root);

}  // namespace hp::train
