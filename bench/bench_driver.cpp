#include "bench/bench_driver.h"

#include <fmt/format.h>
#include <stdlib.h>
#include <torch/version.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "bench/median.h"
#include "bench/op_compare.h"
#include "bench/report_print.h"
#include "bench/row_launch.h"
#include "bench/row_summary.h"
#include "bench/rows.h"
#include "bench/targets.h"

#ifndef HP_BENCH_SOURCE_DIR
#define HP_BENCH_SOURCE_DIR "bench"
#endif

namespace hp::bench {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

std::string self_path() {
  std::error_code ec;
  const fs::path p = fs::read_symlink("/proc/self/exe", ec);
  if (ec) throw std::runtime_error("cannot read /proc/self/exe: " + ec.message());
  return p.string();
}

std::string load_average() {
  std::ifstream in("/proc/loadavg");
  std::string a, b, c;
  in >> a >> b >> c;
  return a + " " + b + " " + c;
}

// Tokens every row trains on: uniform ids from a fixed seed (the content does
// not matter to a step's cost; that every row sees the same does).
void write_tokens(const std::string& path, const BenchConfig& c, int max_ranks) {
  const int64_t needed = (c.warmup + c.steps) * c.batch * max_ranks * c.seq + c.seq + 2;
  const int64_t count = std::max<int64_t>(needed, 1 << 17);
  std::mt19937_64 rng(c.seed);
  std::uniform_int_distribution<int64_t> dist(0, c.vocab - 1);
  std::string bytes(static_cast<size_t>(count) * 2, '\0');
  for (int64_t i = 0; i < count; ++i) {
    const auto t = static_cast<uint16_t>(dist(rng));
    bytes[2 * i] = static_cast<char>(t & 0xff);
    bytes[2 * i + 1] = static_cast<char>(t >> 8);
  }
  std::ofstream out(path, std::ios::binary);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!out) throw std::runtime_error("cannot write the token file " + path);
}

// The run's configuration as the report states it.
json config_json(const BenchConfig& c, int rounds) {
  const bool gpu = c.device == "cuda";
  const std::string reduce = c.reduce_dtype.empty() ? c.param_dtype : c.reduce_dtype;
  return {
      {"model", {{"kind", "GPT-2 (hp::nn::GPT / tests/nn/gpt_reference.py)"},
                 {"vocab", c.vocab}, {"seq", c.seq}, {"d", c.d}, {"heads", c.heads},
                 {"layers", c.layers}, {"ctx", c.ctx}, {"dtype", "float32"}}},
      {"device", c.device},
      {"mixed_precision",
       {{"param_dtype", c.param_dtype}, {"reduce_dtype", reduce},
        {"rows", "the fully_shard rows but ddp, and torch_fsdp2; the others compute in fp32"}}},
      {"batch_per_rank", c.batch},
      {"optimizer", {{"kind", "AdamW"}, {"lr", c.lr}, {"betas", {c.beta1, c.beta2}},
                     {"eps", c.eps}, {"weight_decay", c.weight_decay}}},
      {"data", "uniform random token ids (std::mt19937_64 seed " + std::to_string(c.seed) +
                   "), one file read by every row; hp-train's batch rule (batch_for_step)"},
      {"seed", c.seed},
      {"ranks", c.ranks},
      {"hsdp_ranks", c.hsdp_ranks},
      {"hsdp_mesh", hsdp_mesh(c.hsdp_ranks)},
      {"pipeline", {{"layers", c.pp_layers}, {"microbatches", c.pp_microbatches},
                    {"split", c.pp_split},
                    {"batch", c.batch},
                    {"rows", "pp4* and torch_pp4*: 4 pipeline ranks sharing one batch, no data "
                             "parallelism; dp2_pp2 and torch_dp2_pp2: (dp, pp) = (2, 2), each "
                             "stage sharded over dp, each replica on half of the batch in half "
                             "of the micro-batches"}}},
      {"threads_per_rank", 1},
      {"thread_env", "OMP_NUM_THREADS=OPENBLAS_NUM_THREADS=MKL_NUM_THREADS=1 for every child; "
                     "at::set_num_threads(1) / torch.set_num_threads(1)"},
      {"warmup_steps_per_process", c.warmup},
      {"timed_steps_per_process", c.steps},
      {"rounds", rounds},
      {"timing", std::string("per step: zero_grad + batch slice + forward + loss + backward + "
                             "AdamW step, no barrier; ") +
                     (gpu ? "its GPU time between two CUDA events on the compute stream, the "
                            "step ending with its loss read on the host; "
                          : "") +
                     "each step's time is the max over ranks (gathered after the timed steps); "
                     "the figure is the median over all timed steps of all rounds. Rounds run "
                     "every row once, in forward order then reversed, never two rows at once."},
      {"libtorch", TORCH_VERSION},
      {"machine", {{"cores", std::thread::hardware_concurrency()},
                   {"load_average_at_start", load_average()}}},
      {"note", find_row_spec("hsdp_fused_prefetch").note(c)}};
}

// What the rounds gave, by row name.
struct RoundResults {
  std::map<std::string, std::vector<json>> runs;
  std::map<std::string, std::string> errors;
  std::map<std::string, json> skipped;
};

void run_row_once(const DriverOptions& o, const Launcher& l, const Row& row, int round,
                  RoundResults& out) {
  const std::string label =
      fmt::format("{} (round {}/{})", row.name, round + 1, o.rounds);
  RunOutcome run = launch(label, row_command(l, row, o.config), o.verbose);
  if (!run.ok) {
    // Reported (and the exit status says so), but later rounds still try:
    // a row that failed once may still give numbers.
    out.errors[row.name] += "round " + std::to_string(round + 1) + ": " + run.error;
    return;
  }
  if (run.result.contains("skipped")) {  // e.g. torch_fsdp2 on a PyTorch without FSDP2
    out.skipped[row.name] = run.result;
    std::cerr << "[hp-bench] " << label << ": skipped ("
              << run.result["skipped"].get<std::string>() << ")" << std::endl;
    return;
  }
  std::cerr << "[hp-bench] " << label << ": median "
            << fmt::format("{:.4f} s/step ({:.1f} s wall)",
                           median(run.result["step_times_s"].get<std::vector<double>>()),
                           run.wall_s)
            << std::endl;
  run.result["round"] = round;  // pairs it with the other rows' runs of this round
  out.runs[row.name].push_back(std::move(run.result));
}

// Every row once per round, in forward order then reversed.
RoundResults run_rounds(const DriverOptions& o, const Launcher& l,
                        const std::vector<const Row*>& rows) {
  RoundResults out;
  for (int round = 0; round < o.rounds; ++round) {
    std::vector<const Row*> order = rows;
    if (round % 2 == 1) std::reverse(order.begin(), order.end());
    for (const Row* row : order) run_row_once(o, l, *row, round, out);
  }
  return out;
}

json report_rows(const std::vector<const Row*>& rows, RoundResults& r, const BenchConfig& c) {
  json out = json::array();
  for (const Row* row : rows) {
    const std::string name = row->name;
    const bool failed = r.errors.count(name) > 0;
    if (r.runs[name].empty()) {
      out.push_back(r.skipped.count(name) && !failed ? skipped_row(*row, r.skipped[name], c)
                                                     : failed_row(*row, r.errors[name], c));
      continue;
    }
    json summary = summarize_row(*row, r.runs[name], c);
    if (failed) summary["failed_rounds"] = r.errors[name];
    out.push_back(summary);
  }
  return out;
}

// One of the measurements beside the rows (a worker of ours): its result,
// or the error with `failed` set.
json run_measurement(const DriverOptions& o, const Launcher& l, const std::string& worker,
                     int ranks, bool& failed) {
  RunOutcome run = launch(worker, worker_command(l, worker, ranks, l.timeout_s, o.config),
                          o.verbose);
  failed = !run.ok;
  return run.ok ? run.result : json{{"error", run.error}, {"pass", nullptr}};
}

// fully_shard's hook cost per unit and step, at most 20 us.
json with_hook_target(json hook) {
  const json& fs_variant = hook["variants"]["fully_shard"];
  hook["overhead_us_per_unit_per_step"] = fs_variant["overhead_us_per_unit_per_step"];
  hook["target_us_per_unit_per_step"] = 20.0;
  hook["pass"] = fs_variant["overhead_us_per_unit_per_step"].get<double>() <= 20.0;
  return hook;
}

// The DTensor dispatch's worst cost per op, at most 1 us.
json with_dispatch_target(json dispatch) {
  dispatch["target_us_per_op"] = 1.0;
  dispatch["pass"] = dispatch["worst_overhead_us_per_op"].get<double>() <= 1.0;
  return dispatch;
}

// The checkpoint row, once after the rounds: its summary, or its error in `errors`.
json run_checkpoint(const DriverOptions& o, const Launcher& l, const Row& row,
                    std::map<std::string, std::string>& errors) {
  RunOutcome run = launch(row.name, row_command(l, row, o.config), o.verbose);
  if (run.ok) return summarize_checkpoint(run.result);
  errors[row.name] = run.error;
  return {{"error", run.error}};
}

void write_json(const std::string& path, const json& report) {
  std::error_code ec;
  const fs::path p = path;
  if (p.has_parent_path()) fs::create_directories(p.parent_path(), ec);
  std::ofstream out(path);
  out << report.dump(2) << "\n";
  if (!out) throw std::runtime_error("cannot write " + path);
  std::cout << "\nwrote " << path << std::endl;
}

// Returns false when the plotting script failed.
bool write_plot(const DriverOptions& o) {
  std::error_code ec;
  const fs::path png = o.png_path;
  if (png.has_parent_path()) fs::create_directories(png.parent_path(), ec);
  ChildOutcome plot = run_child({o.python, o.plot_script, o.json_path, o.png_path},
                                [](const std::string& line) { std::cerr << line << "\n"; });
  if (tools::shell_status(plot.result) != 0) {
    std::cerr << "[hp-bench] plot failed (" << tools::describe_exit(plot.result) << ")"
              << std::endl;
    return false;
  }
  std::cout << "wrote " << o.png_path << std::endl;
  return true;
}

// Fills in the defaults of the paths; the launcher for every job.
Launcher resolve_paths(DriverOptions& o) {
  Launcher l;
  l.self = self_path();
  const fs::path build_dir = fs::path(l.self).parent_path().parent_path();
  if (o.hprun.empty()) o.hprun = (build_dir / "tools" / "hprun" / "hprun").string();
  if (o.torch_script.empty()) {
    o.torch_script = std::string(HP_BENCH_SOURCE_DIR) + "/torch_ddp_baseline.py";
  }
  if (o.plot_script.empty()) o.plot_script = std::string(HP_BENCH_SOURCE_DIR) + "/plot_bench.py";
  if (!fs::exists(o.hprun)) {
    throw std::runtime_error("hprun not found at " + o.hprun +
                             " (build it: ninja hprun, or pass --hprun PATH)");
  }
  l.hprun = o.hprun;
  l.python = o.python;
  l.baseline_dir = fs::path(o.torch_script).parent_path().string();
  l.timeout_s = static_cast<int>(o.row_timeout_s);
  return l;
}

// Fair threading on both sides (one intra-op thread per rank) and the token file.
fs::path prepare_run(BenchConfig& c) {
  for (const char* name : {"OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"}) {
    setenv(name, "1", 1);
  }
  char tmpl[] = "/tmp/hp-bench.XXXXXX";
  if (!mkdtemp(tmpl)) throw std::runtime_error("mkdtemp failed");
  const fs::path tmp = tmpl;
  c.tokens_path = (tmp / "tokens.u16").string();
  write_tokens(c.tokens_path, c, std::max(c.ranks, c.hsdp_ranks));
  return tmp;
}

// --profile-ops: our rows' op profiles against their PyTorch peers', printed
// and written to DIR/compare.txt. Returns false when that failed.
bool write_op_comparison(const std::string& dir) {
  try {
    const std::string text = compare_profile_dir(dir);
    if (text.empty()) {
      std::cout << "\n--profile-ops: no pair of rows to compare (single/torch_single, "
                   "ddp/torch_ddp, fsdp_fused_prefetch/torch_fsdp2); profiles in "
                << dir << std::endl;
      return true;
    }
    const std::string path = (fs::path(dir) / "compare.txt").string();
    std::ofstream out(path);
    out << text;
    if (!out) throw std::runtime_error("cannot write " + path);
    std::cout << "\n" << text << "wrote " << path << std::endl;
    return true;
  } catch (const std::exception& e) {
    std::cerr << "[hp-bench] op comparison failed: " << e.what() << std::endl;
    return false;
  }
}

// Rows run once per round (into `step_rows`); the checkpoint row, no
// step-time row, runs once after them: returned, or nullptr.
const Row* split_rows(const std::vector<std::string>& names, std::vector<const Row*>& step_rows) {
  const Row* checkpoint_row = nullptr;
  for (const auto& name : names) {
    const Row& row = find_row_spec(name);
    if (row.launcher == RowLauncher::kCheckpoint) {
      checkpoint_row = &row;
    } else {
      step_rows.push_back(&row);
    }
  }
  return checkpoint_row;
}

}  // namespace

int run_driver(DriverOptions o) {
  BenchConfig& c = o.config;
  if (o.rows.empty()) o.rows = row_names();
  std::vector<const Row*> step_rows;
  const Row* checkpoint_row = split_rows(o.rows, step_rows);
  const Launcher launcher = resolve_paths(o);
  c.steps = (o.total_steps + o.rounds - 1) / o.rounds;
  const fs::path tmp = prepare_run(c);
  json config = config_json(c, o.rounds);
  if (!c.profile_ops_dir.empty()) {
    fs::create_directories(c.profile_ops_dir);
    // The workers add each round to the file of their row and rank: an
    // earlier run's files would be counted too.
    for (const auto& entry : fs::directory_iterator(c.profile_ops_dir)) {
      const std::string name = entry.path().filename().string();
      const std::string suffix = ".ops.json";
      const bool profile = name.size() > suffix.size() &&
                           name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0;
      if (profile || name == "compare.txt") fs::remove(entry.path());
    }
    config["profile_ops"] = {{"dir", c.profile_ops_dir}, {"note", kProfiledStepsNote}};
    std::cerr << "[hp-bench] --profile-ops: " << kProfiledStepsNote << std::endl;
  }

  RoundResults results = run_rounds(o, launcher, step_rows);
  const json rows = report_rows(step_rows, results, c);
  bool hook_failed = false, dispatch_failed = false;
  json hook = json::object(), dispatch = json::object();
  if (o.hook_overhead) {
    hook = run_measurement(o, launcher, "hook_overhead", 1, hook_failed);
    if (!hook_failed) hook = with_hook_target(hook);
  }
  if (o.dispatch_overhead) {
    dispatch = run_measurement(o, launcher, "dispatch_overhead", 2, dispatch_failed);
    if (!dispatch_failed) dispatch = with_dispatch_target(dispatch);
  }
  const json checkpoint =
      checkpoint_row ? run_checkpoint(o, launcher, *checkpoint_row, results.errors) : json();

  config["machine"]["load_average_at_end"] = load_average();
  json report = {{"config", config},
                 {"rows", rows},
                 {"targets", compute_targets(rows, c)},
                 {"hook_overhead", hook},
                 {"dispatch_overhead", dispatch}};
  if (checkpoint_row) report["checkpoint"] = checkpoint;
  print_report(report);
  if (checkpoint_row && !checkpoint.contains("error")) print_checkpoint(checkpoint);

  std::error_code ec;
  fs::remove_all(tmp, ec);
  write_json(o.json_path, report);
  const bool plot_failed = !o.png_path.empty() && !write_plot(o);
  const bool compare_failed =
      !c.profile_ops_dir.empty() && !write_op_comparison(c.profile_ops_dir);

  std::vector<std::string> failed;
  for (const auto& [row, e] : results.errors) failed.push_back(row);
  if (hook_failed) failed.push_back("hook_overhead");
  if (dispatch_failed) failed.push_back("dispatch_overhead");
  if (plot_failed) failed.push_back("plot");
  if (compare_failed) failed.push_back("op comparison");
  if (failed.empty()) return 0;
  std::cerr << "[hp-bench] failed:";
  for (const auto& what : failed) std::cerr << " " << what;
  std::cerr << std::endl;
  return 1;
}

}  // namespace hp::bench
