#include "tools/hp_train/trainer.h"

#include <torch/torch.h>

#include <algorithm>
#include <chrono>

#include "hp/distributed/collectives.h"
#include "hp/fsdp/clip_grad.h"
#include "hp/nn/loss.h"
#include "hp/optim/fused_adamw.h"
#include "hp/util/cuda_memory.h"
#include "hp/util/cuda_timer.h"
#include "hp/util/memory_stats.h"
#include "tools/hp_train/batches.h"

namespace hp::train {

Trainer::Trainer(TrainModel model, std::optional<FSDPModule> root, dist::GroupPtr group,
                 int64_t dp_rank, int64_t dp_size, at::Tensor tokens, const TrainOptions& options,
                 c10::Device device)
    : model_(std::move(model)),
      root_(std::move(root)),
      group_(std::move(group)),
      tokens_(std::move(tokens)),
      options_(options),
      dp_rank_(dp_rank),
      dp_size_(dp_size),
      device_(device) {
  // AdamW with one fused pass per parameter (hp/optim/fused_adamw.h).
  optimizer_ = std::make_unique<optim::FusedAdamW>(
      model_.module().parameters(), torch::optim::AdamWOptions(options_.lr)
                                .betas({0.9, 0.95})
                                .eps(1e-8)
                                .weight_decay(options_.weight_decay));
}

Trainer::~Trainer() = default;

StepRecord Trainer::step(int64_t step) {
  using Clock = std::chrono::steady_clock;
  const auto start = Clock::now();
  reset_peak_memory();
  const bool cuda = device_.is_cuda();
  if (cuda) reset_cuda_peak_memory(device_.index());

  // Gradients are dropped, not zeroed: the sharded units then accumulate a
  // fresh full-size gradient without adding a zero shard to it.
  if (root_) {
    root_->zero_grad();
  } else {
    model_.module().zero_grad(/*set_to_none=*/true);
  }
  Batch batch = batch_for_step(tokens_, step, options_.batch, options_.seq, dp_rank_, dp_size_);
  if (!device_.is_cpu()) {
    batch.inputs = batch.inputs.to(device_);
    batch.targets = batch.targets.to(device_);
  }
  at::Tensor loss = nn::cross_entropy(model_(batch.inputs), batch.targets);
  loss.backward();
  if (options_.grad_clip > 0) clip_grad_norm_(model_.module().parameters(), options_.grad_clip);
  if (before_optimizer_step_) before_optimizer_step_();
  optimizer_->step();

  // One gather carries every metric: each rank's local loss (equal local
  // batches, so their mean is the global-batch mean; under tensor
  // parallelism every rank holds the same loss), its host memory peak and,
  // on a GPU, the caching allocator's two peaks (0 on the CPU).
  // On a GPU, loss.item() waits for the step's kernels: the step time and
  // the allocator's peaks below cover the whole step.
  const double local_loss = loss.item<double>();
  // The host has just waited for the step's kernels: a traced run anchors
  // the trace's GPU clock again here (a sync of an idle stream) and converts
  // the GPU spans the step left (hp/util/gpu_trace.h).
  if (cuda) anchor_cuda_trace(device_);
  CudaMemoryStats gpu;
  if (cuda) gpu = cuda_memory_stats(device_.index());
  at::Tensor mine = torch::tensor({local_loss, static_cast<double>(memory_stats().peak_bytes),
                                   static_cast<double>(gpu.peak_allocated_bytes),
                                   static_cast<double>(gpu.peak_reserved_bytes)},
                                  torch::kDouble);
  at::Tensor all = mine;
  if (group_) {
    all = torch::empty({group_->size() * 4}, torch::kDouble);
    dist::all_gather_into(*group_, all, mine).wait();
  }
  all = all.view({-1, 4});

  StepRecord record;
  record.step = step;
  // Summed in rank order in double: the same bits on every rank and run.
  double loss_sum = 0;
  for (int64_t r = 0; r < all.size(0); ++r) {
    loss_sum += all[r][0].item<double>();
    record.rank_peak_bytes.push_back(static_cast<int64_t>(all[r][1].item<double>()));
    if (cuda) {
      record.rank_cuda_peak_allocated.push_back(static_cast<int64_t>(all[r][2].item<double>()));
      record.rank_cuda_peak_reserved.push_back(static_cast<int64_t>(all[r][3].item<double>()));
    }
  }
  record.loss = loss_sum / static_cast<double>(all.size(0));
  record.peak_bytes =
      *std::max_element(record.rank_peak_bytes.begin(), record.rank_peak_bytes.end());
  record.step_time_s = std::chrono::duration<double>(Clock::now() - start).count();
  record.tokens_per_s =
      static_cast<double>(options_.batch * options_.seq) / std::max(record.step_time_s, 1e-9);
  return record;
}

}  // namespace hp::train
