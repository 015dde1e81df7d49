#include "tools/hp_train/step_log.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <stdexcept>

#include "hp/util/error.h"
#include "tools/hp_train/output_file.h"

namespace hp::train {

StepLog::StepLog(const std::string& path)
    : path_(path), out_(open_output_file("--log-json", path)) {}

void StepLog::set_startup(std::vector<int64_t> peak_bytes, std::vector<int64_t> vmhwm_bytes,
                          bool meta) {
  startup_peak_bytes_ = std::move(peak_bytes);
  startup_vmhwm_bytes_ = std::move(vmhwm_bytes);
  meta_ = meta;
  startup_pending_ = true;
}

void StepLog::write(const StepRecord& record) {
  nlohmann::ordered_json line = {{"step", record.step},
                                 {"loss", record.loss},
                                 {"step_time_s", record.step_time_s},
                                 {"tokens_per_s", record.tokens_per_s},
                                 {"peak_bytes", record.peak_bytes}};
  if (startup_pending_) {
    line["init"] = meta_ ? "meta" : "eager";
    line["startup_peak_bytes"] = startup_peak_bytes_;
    line["startup_vmhwm_bytes"] = startup_vmhwm_bytes_;
    startup_pending_ = false;
  }
  out_ << line.dump() << '\n' << std::flush;
  if (!out_) throw std::runtime_error(fmt::format("--log-json '{}': write failed", path_));
}

}  // namespace hp::train
