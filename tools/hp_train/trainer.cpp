#include "tools/hp_train/trainer.h"

#include <torch/torch.h>

#include <algorithm>
#include <chrono>

#include "hp/dist/collectives.h"
#include "hp/fsdp/clip_grad.h"
#include "hp/nn/loss.h"
#include "hp/optim/fused_adamw.h"
#include "hp/util/memory_stats.h"
#include "tools/hp_train/batches.h"

namespace hp::train {

Trainer::Trainer(TrainModel model, std::optional<FSDPModule> root, dist::GroupPtr group,
                 int64_t dp_rank, int64_t dp_size, at::Tensor tokens, const TrainOptions& options)
    : model_(std::move(model)),
      root_(std::move(root)),
      group_(std::move(group)),
      tokens_(std::move(tokens)),
      options_(options),
      dp_rank_(dp_rank),
      dp_size_(dp_size) {
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

  // Gradients are dropped, not zeroed: the sharded units then accumulate a
  // fresh full-size gradient without adding a zero shard to it.
  if (root_) {
    root_->zero_grad();
  } else {
    model_.module().zero_grad(/*set_to_none=*/true);
  }
  Batch batch = batch_for_step(tokens_, step, options_.batch, options_.seq, dp_rank_, dp_size_);
  at::Tensor loss = nn::cross_entropy(model_(batch.inputs), batch.targets);
  loss.backward();
  if (options_.grad_clip > 0) clip_grad_norm_(model_.module().parameters(), options_.grad_clip);
  if (before_optimizer_step_) before_optimizer_step_();
  optimizer_->step();

  // One gather carries both metrics: every rank's local loss (equal local
  // batches, so their mean is the global-batch mean; under tensor
  // parallelism every rank holds the same loss) and its memory peak.
  at::Tensor mine = torch::tensor(
      {loss.item<double>(), static_cast<double>(memory_stats().peak_bytes)}, torch::kDouble);
  at::Tensor all = mine;
  if (group_) {
    all = torch::empty({group_->size() * 2}, torch::kDouble);
    dist::all_gather_into(*group_, all, mine).wait();
  }
  all = all.view({-1, 2});

  StepRecord record;
  record.step = step;
  // Summed in rank order in double: the same bits on every rank and run.
  double loss_sum = 0;
  for (int64_t r = 0; r < all.size(0); ++r) {
    loss_sum += all[r][0].item<double>();
    record.rank_peak_bytes.push_back(static_cast<int64_t>(all[r][1].item<double>()));
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
