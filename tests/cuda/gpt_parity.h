// fully_shard training of a small GPT on a GPU against one process doing
// the same arithmetic on the same GPU: the CUDA suite's counterpart of
// tests/fsdp/gpt_fixture.h's expect_training_matches.
//
// Why one process on the same GPU: each rank's forward and backward of its
// rows run the kernels the reference runs for the same rows on the same
// (gathered bit for bit) parameters, so each rank's loss equals the
// reference's part loss exactly, and a gradient differs from the
// reference's only in the order the collectives add the parts
// (tests/fsdp/data_parallel_reference.h's argument): reordered_sum_bound of
// the parts' terms in the reduction dtype. Parameters after AdamW are held
// to AdamWBound of those gradient bounds. After each step the reference
// takes the sharded model's parameters (gathered), so each step starts
// equal and nothing compounds.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>

#include <ATen/core/Tensor.h>

#include "hp/fsdp/fully_shard.h"
#include "hp/nn/gpt.h"

namespace hp::cuda_test {

// A GPT whose every dim divides by 1, 2 and 4 (vocab 64, context 16, 2
// layers of width 32 over 2 heads), so each shard is exactly torch.chunk's
// piece on either dim; seeded, built on the host and moved to `device`.
nn::GPT make_gpt(c10::Device device, uint64_t seed = 7);

// Each block a unit, then the root; options.mp_policy.output_dtype applies
// to the root only (as tests/fsdp/gpt_fixture.h's shard_gpt).
FSDPModule shard_gpt(nn::GPT& model, const FullyShardOptions& options);

struct TrainingCase {
  FullyShardOptions options;  // options.mesh: a 1-D CUDA mesh or a 2-D (replicate, shard) one
  // Mixed precision: the options' param_dtype. The reference then computes
  // each part on a copy of its fp32 parameters cast to it, its logits cast
  // to fp32 before the loss and its gradients cast to fp32 before the sum:
  // what param_dtype with reduce_dtype and output_dtype fp32 does.
  std::optional<at::ScalarType> compute_dtype;
  // The dim a parameter is sharded on (what options.shard_placement_fn
  // chooses); default 0.
  std::function<int64_t(const at::Tensor& param)> shard_dim;
  // Micro-batches per step: the first ones with set_requires_gradient_sync
  // (false), the last synced. Their gradients add up (not averaged), so the
  // sharded gradient is micro_batches times the mean over the step's rows.
  int64_t micro_batches = 1;
  int64_t steps = 2;
  // Runs on the root once the tree is built (e.g. a setter).
  std::function<void(FSDPModule&)> configure;
};

// Trains and checks (every rank): this rank's loss of each micro-batch,
// every gradient shard, and every parameter shard after AdamW.
void expect_training_matches(const TrainingCase& c);

}  // namespace hp::cuda_test
