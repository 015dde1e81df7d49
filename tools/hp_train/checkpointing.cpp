#include "tools/hp_train/checkpointing.h"

#include <torch/torch.h>

#include <fmt/format.h>

#include <chrono>
#include <filesystem>
#include <vector>

#include "hp/checkpoint/agreement.h"
#include "hp/checkpoint/async_save.h"
#include "hp/checkpoint/checkpoint.h"
#include "hp/checkpoint/directory.h"
#include "hp/checkpoint/consolidated.h"
#include "hp/checkpoint/metadata.h"
#include "hp/checkpoint/file_io.h"
#include "hp/checkpoint/safetensors.h"
#include "hp/checkpoint/training_state.h"
#include "hp/util/error.h"
#include "tools/hp_train/progress.h"
#include "tools/hp_train/step_log.h"

namespace hp::train {

void validate_checkpoint_options(const TrainOptions& o, const Parallelism& parallelism) {
  HP_CHECK_ARG(o.save_every == 0 || !o.save_dir.empty(), "--save-every ", o.save_every,
               " needs --save-dir DIR (where the checkpoints go)");
  HP_CHECK_ARG(!o.save_async || !o.save_dir.empty(),
               "--save-async needs --save-dir DIR (where the checkpoints go)");
  HP_CHECK_ARG(o.resume != kResumeAuto || !o.save_dir.empty(),
               "--resume auto needs --save-dir DIR (the folder it resumes from)");
  const std::string suffix = ".safetensors";
  HP_CHECK_ARG(o.export_path.empty() ||
                   (o.export_path.size() > suffix.size() &&
                    o.export_path.compare(o.export_path.size() - suffix.size(), suffix.size(),
                                          suffix) == 0),
               "--export '", o.export_path, "' must name a .safetensors file");
}

void prepare_save_dir(const TrainOptions& o) {
  if (o.save_dir.empty()) return;
  std::error_code ec;
  std::filesystem::create_directories(o.save_dir, ec);
  HP_CHECK_ARG(!ec, "--save-dir '", o.save_dir, "' cannot be created: ", ec.message());
}

std::optional<ResumePoint> find_resume_point(const TrainOptions& o, TrainModel& model,
                                             bool say) {
  if (o.resume.empty()) return std::nullopt;
  const bool automatic = o.resume == kResumeAuto;
  const std::string root = automatic ? o.save_dir : o.resume;
  const std::vector<checkpoint::CheckpointDir> candidates = checkpoint::complete_checkpoints(root);
  // auto: a first attempt (nothing saved yet) starts from scratch.
  if (automatic && candidates.empty()) return std::nullopt;
  HP_CHECK_ARG(!candidates.empty(), "--resume '", o.resume,
               "' holds no complete checkpoint (a step-N directory with metadata.json)");
  // The newest whose metadata passes its checks: a corrupt newest one must
  // not fail every restart of the job the same way.
  std::optional<std::string> latest;
  checkpoint::Metadata metadata;
  std::vector<std::string> failures;
  for (size_t i = 0; i < candidates.size() && !latest; ++i) {
    const std::string metadata_path = candidates[i].path + "/metadata.json";
    try {
      metadata = checkpoint::Metadata::parse(checkpoint::read_whole_file(metadata_path),
                                             metadata_path);
      latest = candidates[i].path;
    } catch (const std::exception& e) {
      failures.push_back(exception_message(e));
      if (say) {
        fmt::print(stderr, "hp-train: --resume: skipping {}, which fails its checks: {}{}\n",
                   candidates[i].path, exception_message(e),
                   i + 1 < candidates.size()
                       ? fmt::format("; falling back to {}", candidates[i + 1].path)
                       : std::string());
      }
    }
  }
  if (!latest) {
    std::string message = fmt::format("--resume '{}': no checkpoint in it passes its checks:",
                                      o.resume);
    for (const std::string& f : failures) message += "\n  " + f;
    throw_argument_error(message);
  }
  HP_CHECK_ARG(metadata.step <= o.steps, "--resume '", *latest, "' was saved after ",
               metadata.step, " steps, more than --steps ", o.steps,
               " (--steps is the total, counting the steps before the checkpoint)");
  // The model this run builds against the one saved: a different shape
  // would fail the load after the process group is up; say it now, in
  // terms of the flags.
  std::vector<std::string> problems;
  for (const auto& item : model.module().named_parameters(/*recurse=*/true)) {
    const std::string key = "model." + item.key();
    const checkpoint::TensorRecord* saved = metadata.find(key);
    const std::vector<int64_t> shape = item.value().sizes().vec();
    if (saved == nullptr) {
      problems.push_back(fmt::format("'{}' is not in the checkpoint", item.key()));
    } else if (saved->shape != shape) {
      problems.push_back(fmt::format("'{}' has shape {} in the checkpoint, {} in this run",
                                     item.key(), to_string(saved->shape), to_string(shape)));
    }
  }
  const auto parameters = model.module().named_parameters(/*recurse=*/true);
  for (const auto& [key, record] : metadata.tensors) {
    if (key.rfind("model.", 0) == 0 && parameters.find(key.substr(6)) == nullptr) {
      problems.push_back(fmt::format("the checkpoint has '{}', which this run's model lacks",
                                     key.substr(6)));
    }
  }
  if (!problems.empty()) {
    std::string message = fmt::format(
        "--resume '{}' holds another model than this run builds (--model {} --layers {} --d {} "
        "--ctx {}, vocab {}): {}",
        *latest, o.model, o.layers, o.d, o.ctx, model.vocab_size(),
        plural(static_cast<int64_t>(problems.size()), "difference"));
    for (size_t i = 0; i < std::min<size_t>(problems.size(), 5); ++i) message += "\n  " + problems[i];
    if (problems.size() > 5) message += fmt::format("\n  ... and {} more", problems.size() - 5);
    throw_argument_error(message);
  }
  return ResumePoint{root, *latest, metadata.step};
}

void agree_on_resume_point(const std::optional<ResumePoint>& point) {
  checkpoint::require_same_on_every_rank(
      point ? point->step : -1, "the checkpoint --resume chose (the step it was saved at)",
      [](int64_t step) {
        return step < 0 ? std::string("none (start from step 0)") : fmt::format("step {}", step);
      });
}

TrainCheckpoints::TrainCheckpoints(TrainModel model, torch::optim::AdamW& optimizer,
                                   const TrainOptions& options)
    : TrainCheckpoints(
          [model, &optimizer](checkpoint::State& state) {
            checkpoint::add_model(state, model.module());
            checkpoint::add_adamw(state, optimizer, model.module());
          },
          options) {}

TrainCheckpoints::TrainCheckpoints(AddModelState add_model_state, const TrainOptions& options)
    : add_model_state_(std::move(add_model_state)), options_(options) {
  if (options_.save_async) async_ = std::make_unique<checkpoint::AsyncCheckpointer>();
}

checkpoint::State TrainCheckpoints::run_state(int64_t& steps_done) {
  checkpoint::State state;
  add_model_state_(state);
  checkpoint::add_int(state, "train.step", steps_done);
  checkpoint::add_cpu_rng(state, "train.rng");
  return state;
}

TrainCheckpoints::~TrainCheckpoints() = default;

TrainCheckpoints::Start TrainCheckpoints::start(const std::optional<ResumePoint>& point,
                                                StepLog* step_log, ProgressMeter& meter) {
  Start start;
  if (!point) {
    if (options_.resume == kResumeAuto) {
      start.line = fmt::format("--resume auto: no complete checkpoint in {} yet; starting from "
                               "step 0", options_.save_dir);
    }
    return start;
  }
  const Resumed resumed = resume(*point);
  start.line = resumed.line;
  start.first_step = resumed.step;
  // The checked checkpoint's data failed its checks: an older one was
  // loaded, and the run (and its log) continues from there.
  if (resumed.step != point->step && step_log) step_log->restart_at(resumed.step);
  meter.start_at(resumed.step);
  return start;
}

bool TrainCheckpoints::due(int64_t steps_done) const {
  if (options_.save_dir.empty()) return false;
  return steps_done == options_.steps ||
         (options_.save_every > 0 && steps_done % options_.save_every == 0);
}

namespace {

std::string saved_line(const checkpoint::SaveResult& r) {
  return fmt::format("checkpoint {} saved: {} in {:.2f} s ({}/s)", r.path,
                     human_bytes(static_cast<int64_t>(r.total_bytes)), r.seconds,
                     human_bytes(static_cast<int64_t>(r.total_bytes / std::max(r.seconds, 1e-9))));
}

// A background save's line: its stall is save()'s, plus the optimizer
// steps' waits for its copy (in r.stall_seconds), plus `waited`, the seconds
// the loop then waited for its write to end when training was still going.
std::string async_line(const checkpoint::SaveResult& r, double waited, bool training) {
  const std::string after =
      training ? "" : fmt::format(" (and waited {:.2f} s for it after the last step)", waited);
  return fmt::format("{} in the background; training stalled {:.3f} s{}", saved_line(r),
                     r.stall_seconds + (training ? waited : 0.0), after);
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

std::string TrainCheckpoints::save(int64_t steps_done) {
  int64_t step = steps_done;
  if (!async_) {
    return saved_line(
        checkpoint::save(run_state(step), options_.save_dir, steps_done));
  }
  std::string previous;
  if (async_->in_flight()) {
    const auto t0 = std::chrono::steady_clock::now();
    checkpoint::SaveResult r = async_->wait();
    r.stall_seconds += staging_wait_s_;
    previous = async_line(r, seconds_since(t0), /*training=*/true);
  }
  staging_wait_s_ = 0;
  async_->save(run_state(step), options_.save_dir, steps_done, {},
               checkpoint::Staging::kInBackground);
  return previous;
}

void TrainCheckpoints::wait_for_staging() {
  if (!async_) return;
  const auto t0 = std::chrono::steady_clock::now();
  async_->wait_for_staging();
  staging_wait_s_ += seconds_since(t0);
}

std::string TrainCheckpoints::finish() {
  if (!async_ || !async_->in_flight()) return "";
  const auto t0 = std::chrono::steady_clock::now();
  checkpoint::SaveResult r = async_->wait();
  r.stall_seconds += staging_wait_s_;
  staging_wait_s_ = 0;
  return async_line(r, seconds_since(t0), /*training=*/false);
}

TrainCheckpoints::Resumed TrainCheckpoints::resume(const ResumePoint& point) {
  int64_t step = -1;
  checkpoint::State state = run_state(step);
  // From the root, up to the step checked: a chunk that fails its checksum
  // falls back to the checkpoint before (said on stderr by load).
  checkpoint::LoadOptions options;
  options.newest_step = point.step;
  const checkpoint::LoadResult r = checkpoint::load(state, point.root, options);
  std::string line = fmt::format("resumed from {} after {}: read {} on this rank in {:.2f} s",
                                 r.path, plural(step, "step"),
                                 human_bytes(static_cast<int64_t>(r.bytes_read)), r.seconds);
  if (!r.skipped.empty()) {
    line += fmt::format(" (skipped {} that failed its checks)",
                        plural(static_cast<int64_t>(r.skipped.size()), "newer checkpoint"));
  }
  return {line, step};
}

namespace {

std::string exported_line(const std::string& path, uint64_t bytes,
                          std::chrono::steady_clock::time_point start) {
  return fmt::format("weights exported to {}: {} in {:.2f} s", path,
                     human_bytes(static_cast<int64_t>(bytes)), seconds_since(start));
}

}  // namespace

std::string export_weights(const TrainModel& model, const TrainOptions& options) {
  checkpoint::State weights;
  checkpoint::add_model(weights, model.module());
  const auto start = std::chrono::steady_clock::now();
  const uint64_t bytes = checkpoint::export_consolidated(weights, options.export_path, "model.");
  return exported_line(options.export_path, bytes, start);
}

std::string export_gathered_weights(const TrainModel* model, const TrainOptions& options) {
  const auto start = std::chrono::steady_clock::now();
  checkpoint::run_agreed([&] {
    if (model == nullptr) return;
    // The names and order export_consolidated gives a whole model's state.
    std::vector<std::pair<std::string, at::Tensor>> tensors;
    for (const auto& item : model->module().named_parameters(/*recurse=*/true))
      tensors.emplace_back(item.key(), item.value().detach());
    checkpoint::write_safetensors(options.export_path, tensors);
  });
  std::error_code ec;
  const auto bytes = std::filesystem::file_size(options.export_path, ec);
  return exported_line(options.export_path, ec ? 0 : static_cast<uint64_t>(bytes), start);
}

}  // namespace hp::train
