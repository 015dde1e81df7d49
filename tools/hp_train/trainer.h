// hp-train's step: this rank's slice of the global batch through forward,
// cross-entropy, backward, gradient clipping and AdamW, plus the step's
// metrics agreed by all ranks.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "hp/distributed/group.h"
#include "hp/fsdp/fully_shard.h"
#include "tools/hp_train/model.h"
#include "tools/hp_train/train_options.h"

namespace torch::optim {
class AdamW;
}

namespace hp::train {

struct StepRecord {
  int64_t step = 0;        // the s of the batch rule (0-based)
  double loss = 0;         // global-batch mean: mean over ranks of their local mean losses
  double step_time_s = 0;  // this rank's wall time, through the metrics' gather
  double tokens_per_s = 0; // global tokens (batch * seq) / step_time_s
  int64_t peak_bytes = 0;  // the highest of rank_peak_bytes
  std::vector<int64_t> rank_peak_bytes;  // per rank: peak libtorch CPU memory in this step
  // On a GPU, per rank: the CUDA caching allocator's peaks in this step
  // (bytes allocated to tensors, and reserved from the driver); empty on
  // the CPU.
  std::vector<int64_t> rank_cuda_peak_allocated;
  std::vector<int64_t> rank_cuda_peak_reserved;
};

class Trainer {
 public:
  // `model` is already sharded when `root` is set (its fully_shard handle)
  // or by tensor parallelism; `group` holds every rank (the world), null in
  // one process; this rank reads the slice `dp_rank` of `dp_size` of each
  // global batch.
  // The optimizer is built here from model->parameters(), after sharding, so
  // it steps the local shards: AdamW, constant options.lr, betas (0.9, 0.95),
  // eps 1e-8, options.weight_decay on every parameter. Needs
  // hp::enable_memory_tracking() to have been called.
  // `device` is where the model computes: each batch is copied there, and
  // on a GPU the step's CUDA memory peaks are measured too.
  Trainer(TrainModel model, std::optional<FSDPModule> root, dist::GroupPtr group, int64_t dp_rank,
          int64_t dp_size, at::Tensor tokens, const TrainOptions& options,
          c10::Device device = c10::kCPU);
  ~Trainer();

  // Runs step `step` (collective in a distributed run; every rank calls it
  // with the same step) and returns its metrics, the same on every rank but
  // for step_time_s and tokens_per_s.
  StepRecord step(int64_t step);

  // The optimizer, for checkpoints (tools/hp_train/checkpointing.h).
  torch::optim::AdamW& optimizer() { return *optimizer_; }

  // Runs before every optimizer step, the first change a step makes to the
  // parameters and AdamW's state: a checkpoint copying them in the
  // background (--save-async) is waited for there.
  void set_before_optimizer_step(std::function<void()> fn) {
    before_optimizer_step_ = std::move(fn);
  }

 private:
  TrainModel model_;
  std::optional<FSDPModule> root_;
  dist::GroupPtr group_;
  at::Tensor tokens_;
  TrainOptions options_;
  int64_t dp_rank_ = 0;
  int64_t dp_size_ = 1;
  c10::Device device_;
  std::unique_ptr<torch::optim::AdamW> optimizer_;
  std::function<void()> before_optimizer_step_;
};

}  // namespace hp::train
