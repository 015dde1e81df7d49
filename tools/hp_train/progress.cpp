#include "tools/hp_train/progress.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

namespace hp::train {

ProgressMeter::ProgressMeter(int64_t total_steps, int64_t tokens_per_step, int64_t window)
    : total_(total_steps), tokens_per_step_(tokens_per_step), window_(window) {}

void ProgressMeter::record(double step_time_s) {
  ++done_;
  recent_.push_back(step_time_s);
  recent_sum_ += step_time_s;
  if (recent_.size() > window_) {
    recent_sum_ -= recent_.front();
    recent_.pop_front();
  }
}

void ProgressMeter::set_mfu_basis(double flops_per_step, double peak_flops) {
  flops_per_step_ = flops_per_step;
  peak_flops_ = peak_flops;
}

double ProgressMeter::per_step() const {
  return recent_.empty() ? 0 : recent_sum_ / static_cast<double>(recent_.size());
}

std::optional<double> ProgressMeter::mfu() const {
  const double per_step = this->per_step();
  if (per_step <= 0 || flops_per_step_ <= 0 || peak_flops_ <= 0) return std::nullopt;
  return flops_per_step_ / per_step / peak_flops_;
}

std::string ProgressMeter::line(double loss,
                                std::optional<std::pair<int64_t, int64_t>> gpu_peaks) const {
  const double per_step = this->per_step();
  const double tokens_per_s = per_step > 0 ? tokens_per_step_ / per_step : 0;
  const size_t width = fmt::formatted_size("{}", total_);
  std::string text = fmt::format("step {:>{}}/{} | loss {:.4f} | {} tok/s", done_, width, total_,
                                 loss, human_count(tokens_per_s));
  if (const auto m = mfu()) text += fmt::format(" | MFU {:.1f}%", *m * 100);
  // Milliseconds stay visible on a GPU's short steps.
  text += per_step < 0.1 ? fmt::format(" | {:.3f} s/step", per_step)
                         : fmt::format(" | {:.2f} s/step", per_step);
  if (gpu_peaks) {
    text += fmt::format(" | GPU peak {} alloc / {} reserved", human_bytes(gpu_peaks->first),
                        human_bytes(gpu_peaks->second));
  }
  return text + fmt::format(" | ETA {}", clock_time(per_step * static_cast<double>(total_ - done_)));
}

std::string plural(int64_t count, const std::string& noun) {
  return fmt::format("{} {}{}", count, noun, count == 1 ? "" : "s");
}

std::string human_count(double value) {
  if (value < 1e3) return fmt::format("{:.0f}", value);
  if (value < 1e6) return fmt::format("{:.1f}k", value / 1e3);
  if (value < 1e9) return fmt::format("{:.2f}M", value / 1e6);
  return fmt::format("{:.2f}G", value / 1e9);
}

std::string human_bytes(int64_t bytes) {
  const double b = static_cast<double>(bytes);
  if (b < 1024) return fmt::format("{:.0f} B", b);
  if (b < 1024.0 * 1024) return fmt::format("{:.1f} KiB", b / 1024);
  if (b < 1024.0 * 1024 * 1024) return fmt::format("{:.1f} MiB", b / (1024.0 * 1024));
  return fmt::format("{:.2f} GiB", b / (1024.0 * 1024 * 1024));
}

std::string clock_time(double seconds) {
  const long long total = std::llround(std::max(0.0, seconds));
  const long long h = total / 3600, m = total / 60 % 60, s = total % 60;
  if (h > 0) return fmt::format("{}:{:02}:{:02}", h, m, s);
  return fmt::format("{}:{:02}", m, s);
}

}  // namespace hp::train
