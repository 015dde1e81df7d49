#include "tools/hp_train/progress.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

namespace hp::train {
namespace {

std::string printf_string(const char* format, double value) {
  char buffer[64];
  std::snprintf(buffer, sizeof buffer, format, value);
  return buffer;
}

}  // namespace

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

std::string ProgressMeter::line(double loss) const {
  const double per_step = recent_.empty() ? 0 : recent_sum_ / recent_.size();
  const double tokens_per_s = per_step > 0 ? tokens_per_step_ / per_step : 0;
  const int width = static_cast<int>(std::to_string(total_).size());
  char head[96];
  std::snprintf(head, sizeof head, "step %*lld/%lld | loss %.4f | ", width,
                static_cast<long long>(done_), static_cast<long long>(total_), loss);
  return std::string(head) + human_count(tokens_per_s) + " tok/s | " +
         printf_string("%.2f", per_step) + " s/step | ETA " +
         clock_time(per_step * static_cast<double>(total_ - done_));
}

std::string human_count(double value) {
  if (value < 1e3) return printf_string("%.0f", value);
  if (value < 1e6) return printf_string("%.1fk", value / 1e3);
  if (value < 1e9) return printf_string("%.2fM", value / 1e6);
  return printf_string("%.2fG", value / 1e9);
}

std::string human_bytes(int64_t bytes) {
  const double b = static_cast<double>(bytes);
  if (b < 1024) return printf_string("%.0f B", b);
  if (b < 1024.0 * 1024) return printf_string("%.1f KiB", b / 1024);
  if (b < 1024.0 * 1024 * 1024) return printf_string("%.1f MiB", b / (1024.0 * 1024));
  return printf_string("%.2f GiB", b / (1024.0 * 1024 * 1024));
}

std::string clock_time(double seconds) {
  const long long total = std::llround(std::max(0.0, seconds));
  const long long h = total / 3600, m = total / 60 % 60, s = total % 60;
  char buffer[48];
  if (h > 0) {
    std::snprintf(buffer, sizeof buffer, "%lld:%02lld:%02lld", h, m, s);
  } else {
    std::snprintf(buffer, sizeof buffer, "%lld:%02lld", m, s);
  }
  return buffer;
}

}  // namespace hp::train
