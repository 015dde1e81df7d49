// A job that survives failures, end to end: hp-train under
// `hprun --max-restarts 5` with `--resume auto`, while a killer thread in
// this test kills ranks of the running job.
//
// - Kills: SIGKILL to a random rank at a random step after the first
//   checkpoint (or, at most once, in an attempt's start-up), three times,
//   one of them while a
//   checkpoint is being written: the moment its temporary directory
//   appears. That kill counts as one during a save only if the checkpoint
//   was then never committed; else another kill tries again. Every attempt
//   resumes from the newest committed checkpoint.
// - Hang: SIGSTOP to a random rank at a random step. Its peers' collectives
//   time out (HP_TIMEOUT_S), they exit with an error, and hprun restarts the
//   job.
//
// The kills run with --save-async (a save's copy and write run beside
// training), the hang with synchronous saves. Either way the job must end
// as an uninterrupted run of the same flags
// ends, bit for bit: the same loss at every step of the log (one line per
// step) and the same exported weights. Nothing is bounded: the data of step
// s is a function of s, and a checkpoint restores the weights, AdamW's state
// and the generator exactly, so every step repeats the same arithmetic.
//
// The killer's choices come from a seed printed on failure; HP_CHAOS_SEED
// replays one.
#include <signal.h>
#include <sys/inotify.h>
#include <unistd.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <optional>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "hp/checkpoint/safetensors.h"
#include "tests/hp_train/hp_train_runner.h"
#include "tests/launcher/process_runner.h"
#include "tests/support/tensor_checks.h"

namespace hp::train {
namespace {

namespace fs = std::filesystem;
using launcher::testing::now_seconds;
using launcher::testing::process_alive;
using launcher::testing::read_proc_file;
using launcher::testing::ProcessResult;
using launcher::testing::RunningProcess;
using launcher::testing::TempDir;
using test_run::Args;
using test_run::concat;
using test_run::describe;
using test_run::hp_train;
using testing::HasSubstr;

// The tiny GPT of the other run tests, 150 steps (about 5 s of training
// here), a progress line per step for the killer to follow.
constexpr int64_t kSteps = 150;

// `batch` is the global batch: a multiple of the world size.
Args run_flags(int batch) {
  return {"--layers", "2", "--d", "32", "--heads", "2", "--ctx", "16", "--seq", "16",
          "--batch", std::to_string(batch), "--lr", "1e-2", "--sample-tokens", "0",
          "--log-every", "1", "--steps", std::to_string(kSteps)};
}

// The global RANK of a process, from its environment, or -1.
int rank_of(pid_t pid) {
  std::istringstream in(read_proc_file(pid, "environ"));
  std::string entry;
  while (std::getline(in, entry, '\0')) {
    if (entry.rfind("RANK=", 0) == 0) return std::atoi(entry.c_str() + 5);
  }
  return -1;
}

pid_t parent_of(pid_t pid) {
  const std::string stat = read_proc_file(pid, "stat");
  const auto paren = stat.rfind(')');
  if (paren == std::string::npos) return -1;
  char state = 0;
  int ppid = -1;
  if (std::sscanf(stat.c_str() + paren + 1, " %c %d", &state, &ppid) != 2) return -1;
  return ppid;
}

// The live ranks the launcher started (its children), by global rank.
std::map<int, pid_t> ranks_of(pid_t launcher) {
  std::map<int, pid_t> ranks;
  for (const auto& entry : fs::directory_iterator("/proc")) {
    const std::string name = entry.path().filename().string();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    const pid_t pid = std::atoi(name.c_str());
    if (parent_of(pid) != launcher || !process_alive(pid)) continue;
    const int rank = rank_of(pid);
    if (rank >= 0) ranks[rank] = pid;
  }
  return ranks;
}

// Checkpoint directories appearing in a save root: ".tmp-step-N" is a save
// beginning (checkpoint.h).
class SaveWatch {
 public:
  explicit SaveWatch(const std::string& root) : fd_(::inotify_init1(IN_NONBLOCK | IN_CLOEXEC)) {
    if (fd_ < 0 || ::inotify_add_watch(fd_, root.c_str(), IN_CREATE) < 0) {
      throw std::runtime_error("inotify on " + root + " failed");
    }
  }
  ~SaveWatch() { ::close(fd_); }

  // Forgets what happened so far.
  void drain() { next_temp_dir(0); }

  // The name of the next temporary checkpoint directory created, or "" after
  // limit_s.
  std::string next_temp_dir(double limit_s) {
    const double deadline = now_seconds() + limit_s;
    alignas(inotify_event) char buffer[4096];
    do {
      const ssize_t n = ::read(fd_, buffer, sizeof buffer);
      for (ssize_t at = 0; at < n;) {
        const auto* event = reinterpret_cast<const inotify_event*>(buffer + at);
        at += static_cast<ssize_t>(sizeof(inotify_event) + event->len);
        const std::string name = event->len > 0 ? event->name : "";
        if (limit_s > 0 && name.rfind(".tmp-step-", 0) == 0) return name;
      }
      if (n <= 0 && limit_s > 0) std::this_thread::sleep_for(std::chrono::microseconds(200));
    } while (now_seconds() < deadline);
    return "";
  }

 private:
  int fd_;
};

// Rank 0's progress lines, "[rank 0] step k/N | loss ...", one per step
// (--log-every 1), as the job prints them.
struct Progress {
  std::atomic<int> lines{0};
  std::atomic<int> step{0};  // k of the last line: steps done

  void on_line(const std::string& line) {
    const std::string head = "[rank 0] step ";
    if (line.rfind(head, 0) != 0) return;
    step = std::atoi(line.c_str() + head.size());
    ++lines;
  }
};

struct ChaosPlan {
  int world = 3;
  int steps = static_cast<int>(kSteps);  // hp-train's --steps
  int kills = 3;             // attempts to end
  int signal = SIGKILL;      // or SIGSTOP: a hang
  bool one_during_a_save = true;
  // Every signal lands at a step of training, none in start-up.
  bool in_training = false;
  int max_kills = 5;         // hprun's --max-restarts
  double attempt_limit_s = 90;  // to see an attempt's ranks start, or end after a kill
};

struct ChaosReport {
  std::vector<std::string> events;
  int kills = 0;
  bool killed_during_save = false;
  std::string error;

  std::string text() const {
    std::string out;
    for (const std::string& e : events) out += "  " + e + "\n";
    return out + (error.empty() ? "" : "  error: " + error + "\n");
  }
};

// Kills ranks of the job under `launcher` as `plan` says, until done or
// `stop` is set. Runs on its own thread.
class Killer {
 public:
  // `progress` follows the job's progress lines as they are printed.
  Killer(pid_t launcher, const std::string& save_root, const Progress& progress,
         const ChaosPlan& plan, uint32_t seed)
      : launcher_(launcher), root_(save_root), progress_(progress), plan_(plan),
        random_(seed), watch_(save_root) {}

  ChaosReport run(const std::atomic<bool>& stop) {
    std::set<pid_t> previous;
    std::uniform_int_distribution<int> save_kill(0, plan_.kills - 1);
    const int save_kill_at = plan_.one_during_a_save ? save_kill(random_) : -1;
    while (!stop && report_.kills < plan_.max_kills &&
           (report_.kills < plan_.kills || wants_save_kill(save_kill_at))) {
      const std::map<int, pid_t> ranks = next_attempt(previous, stop);
      if (ranks.empty()) break;
      const int victim = std::uniform_int_distribution<int>(0, plan_.world - 1)(random_);
      const bool at_save = wants_save_kill(save_kill_at) &&
                           (report_.kills >= save_kill_at ||
                            report_.kills + 1 >= plan_.kills);
      if (at_save) {
        kill_at_save(ranks, victim, stop);
      } else if (!plan_.in_training && !killed_in_startup_ &&
                 std::bernoulli_distribution(0.25)(random_)) {
        killed_in_startup_ = true;
        // In start-up (loading, rendezvous, the resume), which takes about
        // 1 s here.
        const double delay = std::uniform_real_distribution<double>(0.05, 0.8)(random_);
        sleep_unless(delay, stop);
        if (stop) break;
        send(ranks, victim, fmt_delay(delay) + " into the attempt");
      } else {
        // At a random step of the attempt, early enough that the steps
        // left leave room for the kills left.
        if (!wait_for_a_step_line(stop)) break;
        const int first = progress_.step;
        const int kills_left = std::max(1, plan_.kills - report_.kills);
        // After the first checkpoint (--save-every 5): the next attempt
        // resumes.
        const int from = std::max(first, 6);
        const int span = std::max(1, (plan_.steps - from) / (kills_left + 1));
        const int target = from + std::uniform_int_distribution<int>(0, span - 1)(random_);
        while (!stop && progress_.step < target) {
          std::this_thread::sleep_for(std::chrono::microseconds(500));
        }
        // ... and once that checkpoint is committed: it is written in the
        // background (--save-async), so a kill at step 6 could come before
        // step-5 is, and the next attempts would then all start from scratch.
        const double deadline = now_seconds() + plan_.attempt_limit_s;
        while (!stop && !has_committed_checkpoint() && now_seconds() < deadline) {
          std::this_thread::sleep_for(std::chrono::microseconds(500));
        }
        if (stop) break;
        send(ranks, victim, "after step " + std::to_string(progress_.step.load()) + "/" +
                                std::to_string(plan_.steps));
      }
      if (!report_.error.empty()) break;
      wait_until_gone(ranks, stop);
      for (const auto& [rank, pid] : ranks) previous.insert(pid);
    }
    return report_;
  }

 private:
  // Whether the save root holds a committed checkpoint (a step-N directory,
  // not a .tmp- one).
  bool has_committed_checkpoint() const {
    std::error_code ec;
    for (const auto& entry : fs::directory_iterator(root_, ec)) {
      if (entry.path().filename().string().rfind("step-", 0) == 0) return true;
    }
    return false;
  }

  bool wants_save_kill(int save_kill_at) const {
    return save_kill_at >= 0 && !report_.killed_during_save;
  }

  static std::string fmt_delay(double s) {
    return std::to_string(static_cast<int>(s * 1000)) + " ms";
  }

  // Waits for a progress line printed after now.
  bool wait_for_a_step_line(const std::atomic<bool>& stop) {
    const int before = progress_.lines;
    const double deadline = now_seconds() + plan_.attempt_limit_s;
    while (!stop && progress_.lines == before && now_seconds() < deadline) {
      std::this_thread::sleep_for(std::chrono::microseconds(500));
    }
    if (!stop && progress_.lines == before) report_.error = "the attempt printed no step";
    return !stop && progress_.lines != before;
  }

  void sleep_unless(double seconds, const std::atomic<bool>& stop) {
    const double until = now_seconds() + seconds;
    while (!stop && now_seconds() < until) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  }

  // Every rank of an attempt not seen before, once all have started.
  std::map<int, pid_t> next_attempt(const std::set<pid_t>& previous,
                                    const std::atomic<bool>& stop) {
    const double deadline = now_seconds() + plan_.attempt_limit_s;
    while (!stop && now_seconds() < deadline) {
      std::map<int, pid_t> ranks = ranks_of(launcher_);
      bool fresh = static_cast<int>(ranks.size()) == plan_.world;
      for (const auto& [rank, pid] : ranks) fresh = fresh && previous.count(pid) == 0;
      if (fresh) return ranks;
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    if (!stop) report_.error = "no new attempt started within the limit";
    return {};
  }

  void send(const std::map<int, pid_t>& ranks, int victim, const std::string& when) {
    ::kill(ranks.at(victim), plan_.signal);
    ++report_.kills;
    report_.events.push_back((plan_.signal == SIGSTOP ? "SIGSTOP to rank " : "SIGKILL to rank ") +
                             std::to_string(victim) + " (pid " +
                             std::to_string(ranks.at(victim)) + ") " + when);
  }

  // The kill lands as a checkpoint's temporary directory appears. It counts
  // as a kill during a save when that checkpoint is then not committed by
  // the time the attempt's ranks are gone (nothing else can commit it: a
  // new attempt must train up to that step first).
  void kill_at_save(const std::map<int, pid_t>& ranks, int victim, const std::atomic<bool>& stop) {
    watch_.drain();
    std::string temp;
    const double deadline = now_seconds() + plan_.attempt_limit_s;
    while (!stop && temp.empty() && now_seconds() < deadline) temp = watch_.next_temp_dir(0.5);
    if (temp.empty()) {
      if (!stop) report_.error = "no save began within the limit";
      return;
    }
    send(ranks, victim, "as " + temp + " appeared");
    wait_until_gone(ranks, stop);
    const std::string committed = temp.substr(std::string(".tmp-").size());
    const bool during = !fs::exists(fs::path(root_) / committed);
    report_.events.back() += during ? ": " + committed + " was never committed"
                                    : ": too late, " + committed + " was committed";
    report_.killed_during_save = report_.killed_during_save || during;
  }

  void wait_until_gone(const std::map<int, pid_t>& ranks, const std::atomic<bool>& stop) {
    const double deadline = now_seconds() + plan_.attempt_limit_s;
    for (const auto& [rank, pid] : ranks) {
      while (!stop && process_alive(pid) && parent_of(pid) == launcher_ &&
             now_seconds() < deadline) {
        std::this_thread::sleep_for(std::chrono::milliseconds(2));
      }
    }
  }

  pid_t launcher_;
  std::string root_;
  const Progress& progress_;
  ChaosPlan plan_;
  std::mt19937 random_;
  SaveWatch watch_;
  ChaosReport report_;
  bool killed_in_startup_ = false;  // at most one kill in start-up
};

uint32_t chaos_seed() {
  if (const char* seed = std::getenv("HP_CHAOS_SEED")) return static_cast<uint32_t>(std::atol(seed));
  return std::random_device{}();
}

struct LoggedRun {
  std::vector<int64_t> steps;
  std::map<int64_t, double> losses;
};

LoggedRun read_logged_run(const std::string& path) {
  LoggedRun run;
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);) {
    const auto j = nlohmann::json::parse(line);
    run.steps.push_back(j.at("step").get<int64_t>());
    run.losses[run.steps.back()] = j.at("loss").get<double>();
  }
  return run;
}

int count_of(const std::string& text, const std::string& what) {
  int n = 0;
  for (auto at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

// Runs `args` on plan.world ranks under hprun --max-restarts while a killer
// follows `plan`, and checks the result against an uninterrupted run.
// `save_flags` go to the chaos run only (with its --save-dir); `job_err`,
// if given, receives the job's stderr.
void expect_survives(const ChaosPlan& plan, const Args& args, const Args& save_flags,
                     const std::vector<std::string>& env, std::string* job_err = nullptr) {
  TempDir dir;
  ProcessResult straight =
      hp_train(plan.world, concat(args, {"--log-json", dir.file("straight.jsonl"), "--export",
                                         dir.file("straight.safetensors")}));
  ASSERT_EQ(straight.exit_code, 0) << describe(straight);

  const std::string root = dir.file("ckpt");
  fs::create_directories(root);
  Args argv = {HPRUN_PATH, "-n", std::to_string(plan.world), "--max-restarts",
               std::to_string(plan.max_kills), HP_TRAIN_PATH};
  argv = concat(concat(concat(concat(argv, test_run::kOnTheCpu), args), save_flags),
                {"--save-dir", root, "--save-every", "5", "--resume", "auto", "--log-json",
                 dir.file("chaos.jsonl"), "--export", dir.file("chaos.safetensors")});
  const uint32_t seed = chaos_seed();
  SCOPED_TRACE("chaos seed " + std::to_string(seed) + " (HP_CHAOS_SEED replays it)");
  launcher::testing::ProcessResult chaos;
  ChaosReport report;
  {
    tools::ProcessOptions options;
    options.env = concat({"OMP_NUM_THREADS=1"}, env);
    Progress progress;
    options.on_line = [&progress](const std::string& line) { progress.on_line(line); };
    RunningProcess job(argv, options);
    Killer killer(job.pid(), root, progress, plan, seed);
    std::atomic<bool> stop{false};
    std::thread chaos_thread([&] { report = killer.run(stop); });
    chaos = job.wait(/*limit_s=*/240);
    stop = true;
    chaos_thread.join();
  }
  if (job_err) *job_err = chaos.err;
  // The job's output is long (a line per step): its end says enough.
  ProcessResult tail = chaos;
  if (tail.out.size() > 4000) tail.out = "..." + tail.out.substr(tail.out.size() - 4000);
  const std::string what = describe(tail) + "\nthe killer:\n" + report.text();
  // What happened, also when it passed: the kills and hprun's verdicts.
  std::cout << "the killer (seed " << seed << "):\n" << report.text();
  std::istringstream err(chaos.err);
  for (std::string line; std::getline(err, line);) {
    if (line.rfind("hprun: ", 0) == 0) std::cout << "  " << line << "\n";
  }
  ASSERT_EQ(chaos.exit_code, 0) << what;
  EXPECT_EQ(report.error, "") << what;
  EXPECT_GE(report.kills, plan.kills) << what;
  if (plan.one_during_a_save) {
    EXPECT_TRUE(report.killed_during_save) << what;
  }
  EXPECT_EQ(count_of(chaos.err, "hprun: restart "), report.kills) << what;
  EXPECT_THAT(chaos.out, HasSubstr("resumed from " + root)) << what;

  const LoggedRun expected = read_logged_run(dir.file("straight.jsonl"));
  const LoggedRun got = read_logged_run(dir.file("chaos.jsonl"));
  EXPECT_EQ(got.steps, expected.steps) << "one line per step, in order\n" << what;
  for (const auto& [step, loss] : expected.losses) {
    ASSERT_EQ(got.losses.count(step), 1u) << "step " << step << "\n" << what;
    EXPECT_EQ(got.losses.at(step), loss) << "step " << step;
  }
  ASSERT_EQ(got.steps.back(), kSteps - 1);
  const auto weights = checkpoint::read_safetensors(dir.file("chaos.safetensors")).tensors;
  const auto reference = checkpoint::read_safetensors(dir.file("straight.safetensors")).tensors;
  ASSERT_EQ(weights.size(), reference.size());
  for (size_t i = 0; i < reference.size(); ++i) {
    EXPECT_EQ(weights[i].first, reference[i].first);
    EXPECT_TRUE(test::tensors_equal(weights[i].second, reference[i].second))
        << reference[i].first;
  }
}

TEST(Chaos, KilledRanksAreRestartedAndTheRunEndsBitwiseAsAnUninterruptedOne) {
  ChaosPlan plan;
  plan.world = 3;
  plan.kills = 3;
  plan.signal = SIGKILL;
  plan.one_during_a_save = true;
  // Saves written in the background: a kill may land in a save's copy or
  // its write while training goes on.
  expect_survives(plan, run_flags(6), {"--save-async"}, {});
}

TEST(Chaos, AHungRankIsTurnedIntoARestartByTheCollectiveTimeout) {
  ChaosPlan plan;
  plan.world = 2;
  plan.kills = 1;
  plan.signal = SIGSTOP;
  plan.one_during_a_save = false;
  plan.in_training = true;
  // Long enough for a rendezvous of ranks started together on a loaded
  // 2-core machine, short enough to keep the test brief.
  std::string err;
  expect_survives(plan, run_flags(4), {}, {"HP_TIMEOUT_S=10"}, &err);
  // The peer's collective ran into the timeout and said so.
  EXPECT_THAT(err, HasSubstr("timeout 10000 ms")) << err;
}

}  // namespace
}  // namespace hp::train
