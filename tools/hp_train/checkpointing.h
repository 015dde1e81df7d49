// hp-train's checkpoints (C1-C5, C7 in docs/features.md): --save-dir with
// --save-every and --save-async, --resume, --export, in every mode and
// under --pp (docs/pipeline.md, "Checkpoints").
//
// A checkpoint holds the model ("model.<parameter name>"), AdamW's state
// ("optim.<name>.exp_avg", ...), the number of steps done ("train.step")
// and the CPU generator ("train.rng"). The data position is the step: the
// batch of step s is a function of s alone (batches.h), so a resumed run
// continues with the same data order, and the learning rate is constant.
// A pipeline rank adds its stages' tensors under the same keys and declares
// the other stages' (hp/pp/pipeline_checkpoint.h): every mode's checkpoint
// has the whole model's keys and loads in every other.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "tools/hp_train/model.h"
#include "tools/hp_train/train_options.h"

namespace torch::optim {
class AdamW;
}

namespace hp::checkpoint {
class AsyncCheckpointer;
class State;
}

namespace hp::train {

class ProgressMeter;
class StepLog;

// Flag combinations, before any collective: --save-every and --save-async
// need --save-dir,
// --export names a .safetensors file, and --mode tp takes none of the
// checkpoint flags yet (its fused QKV weight is StridedShard, whose pieces
// are not boxes of the global tensor, which the checkpoint format stores).
void validate_checkpoint_options(const TrainOptions& options, const Parallelism& parallelism);

// Creates --save-dir when missing (on every rank: a shared file system sees
// one directory), so that a path that cannot be created is an error before
// training rather than at the first save.
void prepare_save_dir(const TrainOptions& options);

struct ResumePoint {
  std::string root;  // --resume DIR, or --save-dir for auto
  std::string path;  // the checkpoint directory checked
  int64_t step = 0;  // steps done when it was saved
};

// --resume DIR, checked before the process group is joined: the newest
// complete checkpoint in DIR whose metadata passes its checks (a newer one
// that fails them is skipped, said on stderr when `say` (rank 0)), saved at
// a step not beyond --steps, whose model has this run's parameter names and
// shapes. Otherwise hp::ArgumentError naming --resume and what differs
// (e.g. the vocabulary or --d). nullopt without --resume, and for --resume
// auto when --save-dir holds no complete checkpoint yet (a job's first
// attempt: it starts from scratch). Each rank decides alone:
// agree_on_resume_point checks that they decided the same.
std::optional<ResumePoint> find_resume_point(const TrainOptions& options, TrainModel& model,
                                             bool say);

// Collective, once the process group is up: raises CheckpointError on every
// rank, naming both steps and ranks, when the ranks' find_resume_point
// chose different checkpoints (or some none): a network file system that
// shows ranks different directories must not resume them from different
// steps.
void agree_on_resume_point(const std::optional<ResumePoint>& point);

// Adds a run's model and AdamW state to a checkpoint state under the whole
// model's keys ("model.<name>", "optim.<name>.exp_avg", ...), in the same
// order on every rank.
using AddModelState = std::function<void(checkpoint::State&)>;

// Saves and resumes one run's state. Every call is collective, the
// constructor too with --save-async (every rank makes it at the same point:
// it makes the background saves' process group).
class TrainCheckpoints {
 public:
  // A whole model (its parameters plain tensors or DTensors, on any mesh)
  // and the optimizer stepping them (checkpoint::add_model, add_adamw).
  TrainCheckpoints(TrainModel model, torch::optim::AdamW& optimizer, const TrainOptions& options);
  // Any other layout of the model, e.g. a pipeline rank's stages
  // (pp::add_pipeline_model and add_pipeline_adamw, pipeline_run.cpp):
  // `add_model_state` adds the model's and the optimizer's keys; the
  // train.* keys are added here, as for a whole model.
  TrainCheckpoints(AddModelState add_model_state, const TrainOptions& options);
  // Waits for a save in flight (an error of it is dropped: call finish()).
  ~TrainCheckpoints();

  // Whether a checkpoint is due after `steps_done` steps (every
  // --save-every, and at the end).
  bool due(int64_t steps_done) const;
  // Saves DIR/step-<steps_done>. Returns the line of the save that
  // completed ("checkpoint ... saved: 4.2 MiB in 0.05 s"): this one; with
  // --save-async, the previous one ("" for the first), waited for here,
  // while this one is written in the background once its snapshot is taken.
  std::string save(int64_t steps_done);
  // --save-async: waits for the save in flight and returns its line ("" if
  // none). Before --export and before the process group goes.
  std::string finish();
  // --save-async copies the state on the background thread: returns once
  // the last save's copy is done. Before anything changes the parameters or
  // AdamW's state (the optimizer step).
  void wait_for_staging();
  struct Resumed {
    std::string line;  // to print
    int64_t step = 0;  // steps done in the checkpoint loaded
  };
  // Loads `point`'s checkpoint into the model and optimizer, or, when its
  // data fails its checks, the newest older one that passes them
  // (checkpoint.h's load from a root): `step` says which.
  Resumed resume(const ResumePoint& point);
  // The run's first step: 0, or under --resume the step of the checkpoint
  // resume() loaded (an older one when `point`'s data failed its checks:
  // `step_log` then restarts there); `meter` starts there. `line` is what
  // to print: resume()'s, or --resume auto's "no checkpoint yet".
  struct Start {
    int64_t first_step = 0;
    std::string line;
  };
  Start start(const std::optional<ResumePoint>& point, StepLog* step_log, ProgressMeter& meter);

 private:
  // A state of the model, the optimizer and the train.* keys; `steps_done`
  // is written back by a load.
  checkpoint::State run_state(int64_t& steps_done);

  AddModelState add_model_state_;
  TrainOptions options_;
  std::unique_ptr<checkpoint::AsyncCheckpointer> async_;  // --save-async
  double staging_wait_s_ = 0;  // waited in wait_for_staging() since the last save
};

// --export: the whole weights of `model` by parameter name, written to
// options.export_path; returns the line to print. Collective over the job's
// ranks (checkpoint::export_consolidated: DTensors are gathered one at a
// time).
std::string export_weights(const TrainModel& model, const TrainOptions& options);

// --export under --pp: the same file, written by the one rank holding the
// whole model (`model`, the stages gathered on rank 0; null on the other
// ranks). Collective all the same: a failed write raises on every rank
// (checkpoint::run_agreed).
std::string export_gathered_weights(const TrainModel* model, const TrainOptions& options);

}  // namespace hp::train
