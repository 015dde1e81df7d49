// --log-json: one JSON object per line per step, for tools that compare
// runs (parity checks, plots):
//   {"step": 0, "loss": 5.55, "step_time_s": 0.21, "tokens_per_s": 4876.2,
//    "peak_bytes": 12345678}
// and on a GPU the step's CUDA peaks per rank and its MFU (set_mfu_basis).
// step is the 0-based s of the batch rule; loss is the global-batch mean
// written with full double precision (round-trip exact), so runs can be
// compared bit for bit.
#pragma once

#include <cstdint>
#include <fstream>
#include <string>
#include <vector>

#include "tools/hp_train/trainer.h"

namespace hp::train {

class StepLog {
 public:
  // Creates the file and its folder; throws hp::ArgumentError naming
  // --log-json and the path when it cannot be opened for writing. A run that
  // starts at step 0 truncates the file. A resumed run (`first_step` > 0)
  // continues it: the lines of steps before `first_step` stay, in order, and
  // the rest goes (steps an interrupted run logged after its last checkpoint,
  // which this run repeats, and a line torn by a kill), so a job resumed any
  // number of times leaves one line per step, as an uninterrupted one does.
  // The kept lines are rewritten into a new file renamed over the old one: a
  // kill during that leaves the old file whole.
  StepLog(const std::string& path, int64_t first_step);

  // As if constructed with `first_step` (earlier than the first one: a
  // resume that fell back to an older checkpoint); the start-up memory and
  // MFU basis set so far stay.
  void restart_at(int64_t first_step);

  // Appends the record's line and flushes it, so a run that dies keeps the
  // steps it finished.
  void write(const StepRecord& record);
  // The first line written after this carries the start-up memory too:
  // "init" ("eager" or "meta"), "startup_peak_bytes", "startup_vmhwm_bytes"
  // and "startup_before_model_bytes" (per rank; startup.h).
  void set_startup(std::vector<int64_t> peak_bytes, std::vector<int64_t> vmhwm_bytes,
                   std::vector<int64_t> before_model_bytes, bool meta);
  // On GPUs, every line also carries "mfu": flops_per_step / step_time_s /
  // peak_flops (ProgressMeter::set_mfu_basis). Lines of a GPU run carry
  // "cuda_peak_allocated_bytes" and "cuda_peak_reserved_bytes" (per rank)
  // whatever the basis.
  void set_mfu_basis(double flops_per_step, double peak_flops) {
    flops_per_step_ = flops_per_step;
    peak_flops_ = peak_flops;
  }

 private:
  double flops_per_step_ = 0;
  double peak_flops_ = 0;
  std::vector<int64_t> startup_peak_bytes_, startup_vmhwm_bytes_, startup_before_model_bytes_;
  bool meta_ = false;
  bool startup_pending_ = false;
  std::string path_;
  std::ofstream out_;
};

}  // namespace hp::train
