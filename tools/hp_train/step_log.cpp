#include "tools/hp_train/step_log.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <stdexcept>
#include <system_error>
#include <vector>

#include "hp/util/error.h"
#include "tools/hp_train/output_file.h"

namespace hp::train {

namespace {

// The lines of `path` for steps before `first_step`, up to the first line
// that is not a whole step record (a torn write) or goes back in steps.
std::vector<std::string> lines_before(const std::string& path, int64_t first_step) {
  std::vector<std::string> kept;
  std::ifstream in(path);
  int64_t previous = -1;
  for (std::string line; std::getline(in, line);) {
    const nlohmann::json record = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (!record.is_object() || !record.contains("step") || !record["step"].is_number_integer()) {
      break;
    }
    const int64_t step = record["step"].get<int64_t>();
    if (step <= previous || step >= first_step) break;
    previous = step;
    kept.push_back(std::move(line));
  }
  return kept;
}

std::ofstream continued_log(const std::string& path, int64_t first_step) {
  if (first_step == 0) return open_output_file("--log-json", path);
  const std::vector<std::string> kept = lines_before(path, first_step);
  const std::string rewritten = path + ".tmp";
  {
    std::ofstream out = open_output_file("--log-json", rewritten);
    for (const std::string& line : kept) out << line << '\n';
    out.flush();
    HP_CHECK_ARG(out.good(), "--log-json '", rewritten, "': write failed");
  }
  std::error_code error;
  std::filesystem::rename(rewritten, path, error);
  HP_CHECK_ARG(!error, "--log-json '", path, "': cannot replace it with '", rewritten,
               "': ", error.message());
  std::ofstream out(path, std::ios::app);
  HP_CHECK_ARG(out.is_open(), "--log-json '", path, "' cannot be opened for appending");
  return out;
}

}  // namespace

StepLog::StepLog(const std::string& path, int64_t first_step)
    : path_(path), out_(continued_log(path, first_step)) {}

void StepLog::restart_at(int64_t first_step) {
  out_.close();
  out_ = continued_log(path_, first_step);
}

void StepLog::set_startup(std::vector<int64_t> peak_bytes, std::vector<int64_t> vmhwm_bytes,
                          std::vector<int64_t> before_model_bytes, bool meta) {
  startup_peak_bytes_ = std::move(peak_bytes);
  startup_vmhwm_bytes_ = std::move(vmhwm_bytes);
  startup_before_model_bytes_ = std::move(before_model_bytes);
  meta_ = meta;
  startup_pending_ = true;
}

void StepLog::write(const StepRecord& record) {
  nlohmann::ordered_json line = {{"step", record.step},
                                 {"loss", record.loss},
                                 {"step_time_s", record.step_time_s},
                                 {"tokens_per_s", record.tokens_per_s},
                                 {"peak_bytes", record.peak_bytes}};
  if (!record.rank_cuda_peak_allocated.empty()) {
    line["cuda_peak_allocated_bytes"] = record.rank_cuda_peak_allocated;
    line["cuda_peak_reserved_bytes"] = record.rank_cuda_peak_reserved;
  }
  if (flops_per_step_ > 0 && peak_flops_ > 0 && record.step_time_s > 0) {
    line["mfu"] = flops_per_step_ / record.step_time_s / peak_flops_;
  }
  if (startup_pending_) {
    line["init"] = meta_ ? "meta" : "eager";
    line["startup_peak_bytes"] = startup_peak_bytes_;
    line["startup_vmhwm_bytes"] = startup_vmhwm_bytes_;
    line["startup_before_model_bytes"] = startup_before_model_bytes_;
    startup_pending_ = false;
  }
  out_ << line.dump() << '\n' << std::flush;
  if (!out_) throw std::runtime_error(fmt::format("--log-json '{}': write failed", path_));
}

}  // namespace hp::train
