// hp-train's progress display: one whole line every --log-every steps.
//
// Under hprun stdout is a pipe that the launcher splits into prefixed lines,
// so progress is printed as complete lines, never redrawn with '\r':
//   step  120/300 | loss 2.3412 | 15.2k tok/s | 0.21 s/step | ETA 0:45
#pragma once

#include <cstdint>
#include <deque>
#include <optional>
#include <string>
#include <utility>

namespace hp::train {

// Speed is measured over the most recent steps (a window), so the display
// follows the current pace rather than the slow first step (lazy init).
class ProgressMeter {
 public:
  ProgressMeter(int64_t total_steps, int64_t tokens_per_step, int64_t window = 20);

  // Records the step just finished (steps are recorded in order from 0,
  // or from the step given to start_at).
  void record(double step_time_s);
  // A resumed run: `done` steps were finished by an earlier run.
  void start_at(int64_t done) { done_ = done; }

  // On GPUs: the model FLOPs of one step (all ranks together) and the peak
  // of all the job's GPUs together; the line then shows the MFU of the
  // window's pace (tools/hp_train/model_flops.h).
  void set_mfu_basis(double flops_per_step, double peak_flops);

  // The line for the state after the last record(); loss is that step's.
  // `gpu_peaks`: the step's CUDA peaks (allocated, reserved) of the rank
  // with the highest, shown after the speed.
  std::string line(double loss,
                   std::optional<std::pair<int64_t, int64_t>> gpu_peaks = std::nullopt) const;

  // The MFU of the window's pace in [0, 1]; nullopt without a basis or a step.
  std::optional<double> mfu() const;

 private:
  double per_step() const;  // the window's mean step time; 0 before a step

  int64_t total_;
  int64_t tokens_per_step_;
  size_t window_;
  int64_t done_ = 0;
  std::deque<double> recent_;
  double recent_sum_ = 0;
  double flops_per_step_ = 0;
  double peak_flops_ = 0;
};

// (1, "layer") -> "1 layer", (4, "layer") -> "4 layers".
std::string plural(int64_t count, const std::string& noun);
// 950 -> "950", 15234 -> "15.2k", 2.5e6 -> "2.50M".
std::string human_count(double value);
// 2048 -> "2.0 KiB", 13002342 -> "12.4 MiB".
std::string human_bytes(int64_t bytes);
// 45 -> "0:45", 754 -> "12:34", 3723 -> "1:02:03" (rounded to seconds).
std::string clock_time(double seconds);

}  // namespace hp::train
