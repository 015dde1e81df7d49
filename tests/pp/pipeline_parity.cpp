#include "tests/pp/pipeline_parity.h"

#include <gtest/gtest.h>

#include <torch/torch.h>

#include "hp/fsdp/fully_shard.h"
#include "hp/nn/activation_checkpoint.h"
#include "hp/nn/gpt.h"
#include "hp/nn/llama.h"
#include "hp/nn/loss.h"
#include "hp/tensor/dtensor_tensor.h"
#include "hp/tp/gpt_plan.h"
#include "hp/tp/shard_module.h"
#include "hp/util/format.h"
#include "tests/support/model_configs.h"
#include "tests/support/random_tokens.h"
#include "tests/support/tensor_checks.h"

namespace hp::pp::parity {

namespace {

constexpr int kSteps = 2;
constexpr uint64_t kSeed = 21;

int64_t layers_of(const Case& c) {
  return std::max<int64_t>(c.ranks * c.stages_per_rank + 1, 4);
}

std::shared_ptr<nn::Module> build_whole(const Case& c) {
  torch::manual_seed(kSeed);
  if (c.llama) {
    nn::LlamaConfig config = hp::test::tiny_llama_config();
    config.n_layer = layers_of(c);
    nn::Llama llama(config);
    llama->to(c.device);
    return llama.ptr();
  }
  nn::GPT gpt(hp::test::small_gpt_config(layers_of(c)));
  gpt->to(c.device);
  if (c.tp_mesh) shard_module(gpt, c.tp_mesh, gpt_tensor_parallel_plan(gpt->config(), *c.tp_mesh));
  return gpt.ptr();
}

// What this rank holds of a tensor: a DTensor's local shard, else itself.
at::Tensor local(const at::Tensor& t) { return is_dtensor(t) ? local_of(t) : t; }

int64_t vocab_of(const Case& c) {
  return c.llama ? hp::test::tiny_llama_config().vocab_size
                 : hp::test::small_gpt_config().vocab_size;
}

int64_t width_of(const Case& c) {
  return c.llama ? hp::test::tiny_llama_config().n_embd : hp::test::small_gpt_config().n_embd;
}

at::Tensor logits_of(const Case& c, nn::Module& whole, const at::Tensor& ids) {
  return c.llama ? static_cast<nn::LlamaImpl&>(whole).forward(ids)
                 : static_cast<nn::GPTImpl&>(whole).forward(ids);
}

int64_t rows_of(const Case& c) { return 2 * c.microbatches * c.data_parallel; }

at::Tensor batch(const Case& c, int step, uint64_t salt) {
  return hp::test::random_tokens({rows_of(c), 8}, vocab_of(c), 100 * step + salt).to(c.device);
}

torch::optim::AdamWOptions adamw() { return torch::optim::AdamWOptions(1e-2); }

ScheduleSpec spec_of(const Case& c) {
  return {c.kind, c.ranks, c.stages_per_rank, c.microbatches};
}

// Rank `index` of `ranks`' piece of `t` as fully_shard cuts it: dim-0
// chunks of ceil(rows / ranks), the last ones short or empty.
at::Tensor dim0_shard(const at::Tensor& t, int64_t ranks, int64_t index) {
  const int64_t rows = t.size(0);
  const int64_t chunk = (rows + ranks - 1) / ranks;
  const int64_t start = std::min(rows, index * chunk);
  return t.narrow(0, start, std::min(chunk, rows - start));
}

}  // namespace

std::string name_of(const Case& c) {
  return hp::cat(to_string(c.kind), c.data_parallel > 1 ? hp::cat(" dp", c.data_parallel) : "",
                 " p", c.ranks, " v", c.stages_per_rank, " m", c.microbatches,
                 c.split_points.empty() ? "" : " uneven", c.checkpointing ? " checkpointed" : "",
                 c.llama ? " llama" : "", c.fully_shard ? " fully_shard" : "",
                 c.tp_mesh ? hp::cat(" tp", c.tp_mesh->size()) : "",
                 c.device.is_cpu() ? "" : hp::cat(" on ", c.device.str()),
                 c.compute_dtype ? hp::cat(" ", *c.compute_dtype) : "");
}

Run reference_run(const Case& c) {
  std::shared_ptr<nn::Module> whole = build_whole(c);
  torch::optim::AdamW optimizer(whole->parameters(), adamw());
  // Mixed precision: the micro-batches run on this copy, refreshed from the
  // fp32 parameters before each step.
  std::shared_ptr<nn::Module> low;
  if (c.compute_dtype) {
    low = build_whole(c);
    low->to(*c.compute_dtype);
  }
  nn::Module& computes = low ? *low : *whole;
  Run run;
  for (int step = 0; step < kSteps; ++step) {
    const auto ids = batch(c, step, 1).chunk(c.data_parallel);
    const auto targets = batch(c, step, 2).chunk(c.data_parallel);
    if (low) {
      torch::NoGradGuard no_grad;
      auto from = whole->parameters();
      auto to = low->parameters();
      for (size_t i = 0; i < from.size(); ++i) to[i].copy_(from[i]);
    }
    std::vector<std::vector<at::Tensor>> replica_grads;
    for (int r = 0; r < c.data_parallel; ++r) {
      optimizer.zero_grad();
      const auto mb_ids = ids[r].chunk(c.microbatches);
      const auto mb_targets = targets[r].chunk(c.microbatches);
      at::Tensor replica_total;
      std::vector<at::Tensor> sums;  // mixed precision: the micro-batches' gradients in fp32
      for (int k = 0; k < c.microbatches; ++k) {
        if (low) low->zero_grad();
        at::Tensor loss = nn::cross_entropy(logits_of(c, computes, mb_ids[k]).to(at::kFloat),
                                            mb_targets[k]) /
                          c.microbatches;
        loss.backward();
        replica_total = replica_total.defined() ? replica_total + loss.detach() : loss.detach();
        if (!low) continue;
        auto params = low->parameters();
        for (size_t i = 0; i < params.size(); ++i) {
          at::Tensor g = params[i].grad().to(at::kFloat);
          if (sums.size() <= i) {
            sums.push_back(g);
          } else {
            sums[i] = g + sums[i];  // as the units add each one to the kept sum
          }
        }
      }
      if (is_dtensor(replica_total)) replica_total = full_tensor(replica_total);
      if (r == 0) run.losses.push_back(replica_total);
      if (run.replica_losses.size() <= static_cast<size_t>(r)) run.replica_losses.emplace_back();
      run.replica_losses[r].push_back(replica_total);
      std::vector<at::Tensor> grads;
      if (low) {
        grads = std::move(sums);
      } else {
        for (const auto& p : whole->parameters()) grads.push_back(p.grad().clone());
      }
      replica_grads.push_back(std::move(grads));
    }
    auto params = whole->parameters();
    for (size_t i = 0; i < params.size(); ++i) {
      at::Tensor sum = replica_grads[0][i];
      for (int r = 1; r < c.data_parallel; ++r) sum = sum + replica_grads[r][i];
      params[i].mutable_grad() = c.data_parallel > 1 ? sum / c.data_parallel : sum;
    }
    if (step == kSteps - 1)
      for (const auto& item : whole->named_parameters())
        run.grads[item.key()] = item.value().grad().clone();
    optimizer.step();
  }
  for (const auto& item : whole->named_parameters()) run.params[item.key()] = item.value();
  return run;
}

std::vector<StageModule> build_stages(const Case& c, int rank) {
  std::shared_ptr<nn::Module> whole = build_whole(c);
  const ScheduleSpec spec = spec_of(c);
  const ModelLayout layout =
      c.llama ? llama_layout(static_cast<nn::LlamaImpl&>(*whole).config())
              : gpt_layout(static_cast<nn::GPTImpl&>(*whole).config());
  const StagePlan plan = plan_stages(layout, num_stages(spec), c.split_points);
  std::vector<StageModule> stages;
  for (int s : rank_stages(spec, rank)) {
    stages.push_back(c.llama ? llama_stage(static_cast<nn::LlamaImpl&>(*whole), plan, s)
                             : gpt_stage(static_cast<nn::GPTImpl&>(*whole), plan, s));
    if (c.checkpointing)
      for (const auto& block : stages.back()->blocks()) nn::set_activation_checkpointing(*block);
  }
  return stages;
}

Run pipeline_run(const Case& c, std::vector<StageModule> stages,
                 std::shared_ptr<Transport> transport, int replica, dist::GroupPtr replicas,
                 DeviceMeshPtr fsdp_mesh) {
  PipelineOptions options{spec_of(c), width_of(c), c.compute_dtype.value_or(at::kFloat),
                          c.device};
  if (c.fully_shard) {
    FullyShardOptions shard;
    shard.mesh = std::move(fsdp_mesh);
    if (c.compute_dtype) {
      shard.mp_policy.param_dtype = *c.compute_dtype;
      shard.mp_policy.reduce_dtype = at::kFloat;
    }
    for (const StageModule& stage : stages) {
      for (const auto& block : stage->blocks()) fully_shard(block, shard);
      fully_shard(stage.ptr(), shard);
    }
  } else {
    options.data_parallel = std::move(replicas);
  }
  Pipeline pipeline(options, stages, std::move(transport),
                    // fp32 logits to the loss, whatever the compute dtype
                    // (a no-op in fp32), as the reference does.
                    [](const at::Tensor& logits, const at::Tensor& targets) {
                      return nn::cross_entropy(logits.to(at::kFloat), targets);
                    });
  torch::optim::AdamW optimizer(pipeline.parameters(), adamw());
  Run run;
  for (int step = 0; step < kSteps; ++step) {
    optimizer.zero_grad();
    run.losses.push_back(pipeline.step(batch(c, step, 1).chunk(c.data_parallel)[replica],
                                       batch(c, step, 2).chunk(c.data_parallel)[replica]));
    if (step == kSteps - 1)
      for (const auto& s : stages)
        for (const auto& item : s->named_parameters())
          run.grads[item.key()] = item.value().grad().clone();
    optimizer.step();
  }
  for (const auto& s : stages)
    for (const auto& item : s->named_parameters()) run.params[item.key()] = item.value();
  return run;
}

size_t expect_rank_matches(const Case& c, int rank, const Run& got, const Run& reference,
                           int replica) {
  SCOPED_TRACE(hp::cat(name_of(c), ", pipeline rank ", rank, ", replica ", replica));
  const ScheduleSpec spec = spec_of(c);
  const bool has_last = stage_rank(spec, num_stages(spec) - 1) == rank;
  for (size_t step = 0; step < reference.losses.size(); ++step) {
    EXPECT_EQ(got.losses.at(step).defined(), has_last) << "step " << step;
    if (has_last) {
      EXPECT_TRUE(
          hp::test::tensors_equal(got.losses[step], reference.replica_losses.at(replica).at(step)))
          << "step " << step;
    }
  }
  EXPECT_FALSE(got.params.empty());
  // fully_shard and tensor parallelism together lay a parameter out over
  // both dims as fully_shard chooses: the global values are compared (each
  // gathered over its mesh, every rank of it in the same order).
  const bool gather = c.fully_shard && c.tp_mesh;
  auto mine = [&](const at::Tensor& t) { return gather ? full_tensor(t) : local(t); };
  auto held = [&](const at::Tensor& whole) {
    if (gather) return full_tensor(whole);
    return c.fully_shard ? dim0_shard(local(whole), c.data_parallel, replica) : local(whole);
  };
  // (Units over one data-parallel rank hold every tensor whole: they only cast.)
  size_t cut = 0;  // tensors a fully_shard case holds a strict part of
  for (const auto& [name, p] : got.params) {
    cut += local(p).numel() < local(reference.params.at(name)).numel();
    EXPECT_TRUE(hp::test::tensors_equal(mine(got.grads.at(name)), held(reference.grads.at(name))))
        << name;
    EXPECT_TRUE(hp::test::tensors_equal(mine(p), held(reference.params.at(name)))) << name;
  }
  EXPECT_EQ(cut > 0, c.fully_shard && c.data_parallel > 1) << cut << " of " << got.params.size() << " tensors are shards";
  if (c.tp_mesh && c.tp_mesh->size() > 1) {
    EXPECT_TRUE(std::any_of(got.params.begin(), got.params.end(),
                            [](const auto& item) { return is_dtensor(item.second); }))
        << "no parameter of the stages is tensor-parallel";
  }
  return got.params.size();
}

}  // namespace hp::pp::parity
