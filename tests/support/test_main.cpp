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
#include <string>

#include "hp/distributed/launch_env.h"
#include "hp/distributed/world.h"
#include "hp/util/torch_compat.h"
#include "tests/support/rounding_bounds.h"

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
  int status = RUN_ALL_TESTS();
  if (distributed) hp::dist::destroy_process_group();
  return status;
}
