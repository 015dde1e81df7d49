// tools/common/subprocess: what hp-bench relies on beyond the launcher tests'
// use (merged output streamed line by line, exec failures, exit text).
#include "tools/common/subprocess.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <csignal>
#include <string>
#include <vector>

namespace hp::tools {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

TEST(Subprocess, MergedOutputKeepsTheOrderAndStreamsEachLine) {
  ProcessOptions options;
  options.merge_stderr = true;
  std::vector<std::string> lines;
  options.on_line = [&](const std::string& line) { lines.push_back(line); };
  RunningProcess process({"/bin/sh", "-c", "echo one; echo two >&2; printf three"}, options);
  ProcessResult r = process.wait(10);
  EXPECT_TRUE(r.exited);
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_EQ(r.out, "one\ntwo\nthree");
  EXPECT_EQ(r.err, "");
  // The last line arrives without its newline too.
  EXPECT_THAT(lines, ElementsAre("one", "two", "three"));
}

TEST(Subprocess, SeparateStreamsAndEnvironmentOverrides) {
  ProcessResult r =
      run_process({"/bin/sh", "-c", "echo \"$HP_SUBPROCESS_TEST\"; echo e >&2; exit 3"},
                  {"HP_SUBPROCESS_TEST=set"}, 10);
  EXPECT_EQ(r.out, "set\n");
  EXPECT_EQ(r.err, "e\n");
  EXPECT_EQ(shell_status(r), 3);
  EXPECT_EQ(describe_exit(r), "exit status 3");
}

TEST(Subprocess, ExecFailureIsStatus127WithTheReason) {
  ProcessResult r = run_process({"/nonexistent/hp-subprocess-test"}, {}, 10);
  EXPECT_EQ(shell_status(r), 127);
  EXPECT_THAT(r.err, HasSubstr("exec /nonexistent/hp-subprocess-test failed: No such file"));
}

TEST(Subprocess, SignalsAndTimeLimits) {
  ProcessResult killed = run_process({"/bin/sh", "-c", "kill -9 $$"}, {}, 10);
  EXPECT_FALSE(killed.exited);
  EXPECT_EQ(shell_status(killed), 128 + SIGKILL);
  EXPECT_EQ(describe_exit(killed), "killed by signal 9");

  ProcessResult slow = run_process({"/bin/sleep", "30"}, {}, 0.3);
  EXPECT_TRUE(slow.timed_out);
  EXPECT_THAT(describe_exit(slow), HasSubstr("timed out after"));
  EXPECT_LT(slow.seconds, 10);
}

}  // namespace
}  // namespace hp::tools
