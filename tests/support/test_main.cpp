// Shared main of the test binaries.
//
// Under a launcher (hprun: RANK set) it joins the process group before running the tests
// and leaves it after, so every rank runs the same tests in the same order
// and their collectives meet. Ranks other than 0 print only failures, so a
// four-rank log stays readable. Each rank runs torch on one thread: ranks
// share the machine's cores and oversubscription only adds noise.
#include <ATen/Parallel.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <iostream>
#include <memory>
#include <string>

#include "hp/distributed/launch_env.h"
#include "hp/distributed/recording_stream_ops.h"
#include "hp/distributed/world.h"
#include "hp/util/torch_compat.h"
#include "tests/support/rounding_bounds.h"
#include "tests/support/stream_rules.h"

namespace {

// Prints a failing test's name and assertion messages; nothing else.
class FailurePrinter : public testing::EmptyTestEventListener {
  void OnTestPartResult(const testing::TestPartResult& result) override {
    if (result.failed()) {
      std::cerr << result.file_name() << ":" << result.line_number() << ": Failure\n"
                << result.summary() << std::endl;
    }
  }
  void OnTestEnd(const testing::TestInfo& info) override {
    if (info.result()->Failed()) {
      std::cerr << "[  FAILED  ] " << info.test_suite_name() << "." << info.name() << std::endl;
    }
  }
};

// Prints how much of its tolerance each test's closest comparison used
// (HP_TEST_PRINT_BOUND_USE): the slack the derived bounds leave.
class BoundUsePrinter : public testing::EmptyTestEventListener {
 public:
  explicit BoundUsePrinter(int rank) : rank_(rank) {}
  void OnTestStart(const testing::TestInfo&) override { hp::test::reset_worst_bound_use(); }
  void OnTestEnd(const testing::TestInfo& info) override {
    std::cerr << "[bound use] rank " << rank_ << " " << info.test_suite_name() << "."
              << info.name() << ": " << hp::test::worst_bound_use() << std::endl;
  }

 private:
  int rank_;
};

// HP_TEST_STREAMS=record: every test runs with the recording StreamOps on
// the CPU, so fully_shard takes the schedule a GPU runs (docs/streams.md),
// and the log is checked against the ordering rules after each test. A
// broken rule fails the run, naming the test and the entry.
class StreamRuleChecker : public testing::EmptyTestEventListener {
 public:
  void OnTestStart(const testing::TestInfo&) override {
    ops_ = std::make_shared<hp::dist::RecordingStreamOps>();
    scope_ = std::make_unique<hp::dist::ScopedStreamOps>(ops_);
  }
  void OnTestEnd(const testing::TestInfo& info) override {
    scope_.reset();
    const auto log = ops_->entries();
    const auto broken = hp::test::check_stream_rules(log);
    for (const auto& rule : broken) {
      std::cerr << "[stream rules] " << info.test_suite_name() << "." << info.name() << ": "
                << rule;
    }
    if (!broken.empty()) failed_ = true;
    entries_ += log.size();
    ops_.reset();
  }
  bool failed() const { return failed_; }
  size_t entries() const { return entries_; }

 private:
  std::shared_ptr<hp::dist::RecordingStreamOps> ops_;
  std::unique_ptr<hp::dist::ScopedStreamOps> scope_;
  bool failed_ = false;
  size_t entries_ = 0;
};

}  // namespace

int main(int argc, char** argv) {
  testing::InitGoogleTest(&argc, argv);
  // An entry forced onto another CPU code path (tests/CMakeLists.txt) that
  // runs on the native one would only repeat the native entry.
  if (const char* forced = std::getenv("ATEN_CPU_CAPABILITY")) {
    const std::string running = hp::compat::cpu_capability();
    if (!running.empty() && running != forced) {
      std::cerr << "ATEN_CPU_CAPABILITY=" << forced << " but ATen runs its " << running
                << " kernels" << std::endl;
      return 1;
    }
  }
  at::set_num_threads(1);
  const bool distributed = hp::dist::started_by_launcher();
  if (distributed) {
    hp::dist::InitOptions options;
    if (const char* t = std::getenv("HP_TEST_TIMEOUT_S")) {
      options.timeout = std::chrono::seconds(std::atoi(t));
    }
    hp::dist::init_process_group(options);
    if (hp::dist::get_rank() != 0) {
      auto& listeners = testing::UnitTest::GetInstance()->listeners();
      delete listeners.Release(listeners.default_result_printer());
      listeners.Append(new FailurePrinter);
    }
  }
  if (std::getenv("HP_TEST_PRINT_BOUND_USE")) {
    testing::UnitTest::GetInstance()->listeners().Append(
        new BoundUsePrinter(distributed ? hp::dist::get_rank() : 0));
  }
  StreamRuleChecker* stream_rules = nullptr;
  if (const char* streams = std::getenv("HP_TEST_STREAMS")) {
    if (std::string(streams) != "record") {
      std::cerr << "HP_TEST_STREAMS=" << streams << ": expected 'record'" << std::endl;
      return 1;
    }
    stream_rules = new StreamRuleChecker;  // owned by the listener list
    testing::UnitTest::GetInstance()->listeners().Append(stream_rules);
  }
  int status = RUN_ALL_TESTS();
  if (stream_rules != nullptr) {
    if (stream_rules->entries() == 0) {
      std::cerr << "[stream rules] HP_TEST_STREAMS=record but no test recorded a stream "
                   "decision: nothing was checked" << std::endl;
      status = 1;
    }
    if (stream_rules->failed()) status = 1;
  }
  if (distributed) hp::dist::destroy_process_group();
  return status;
}
