// Unit tests of hprun's pieces that need no child processes: the command
// line, the rank environment, line splitting and exit status wording.

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "tools/hprun/attempt.h"
#include "tools/hprun/exit_status.h"
#include "tools/hprun/free_port.h"
#include "tools/hprun/line_prefixer.h"
#include "tools/hprun/options.h"
#include "tools/hprun/rank_env.h"

namespace hp::launcher {
namespace {

using Args = std::vector<std::string>;

std::string usage_error(const Args& args) {
  try {
    parse_command_line(args);
  } catch (const UsageError& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(ParseCommandLine, DefaultsForASingleNode) {
  LaunchOptions o = parse_command_line({"-n", "4", "prog"}).options;
  EXPECT_EQ(o.nproc_per_node, 4);
  EXPECT_EQ(o.nnodes, 1);
  EXPECT_EQ(o.node_rank, 0);
  EXPECT_EQ(o.master_addr, "127.0.0.1");
  EXPECT_EQ(o.master_port, 0);
  EXPECT_TRUE(o.prefix_output);
  EXPECT_EQ(o.timeout_s, 0);
  EXPECT_EQ(o.command, Args{"prog"});
  EXPECT_EQ(o.world_size(), 4);
  // Node 0's agent listens on loopback unless told otherwise.
  EXPECT_EQ(o.rdzv_bind, "127.0.0.1");
  EXPECT_EQ(o.rdzv_secret_file, "");
}

TEST(ParseCommandLine, AgentBindAndSecretFile) {
  LaunchOptions o = parse_command_line({"--nnodes", "2", "-n", "1", "--master-addr", "10.0.0.1",
                                        "--master-port", "29500", "--rdzv-bind", "0.0.0.0",
                                        "--rdzv-secret-file", "/run/job.secret", "prog"})
                        .options;
  EXPECT_EQ(o.rdzv_bind, "0.0.0.0");
  EXPECT_EQ(o.rdzv_secret_file, "/run/job.secret");
  // Followers do not listen: no --rdzv-bind needed there.
  EXPECT_NO_THROW(parse_command_line({"--nnodes", "2", "--node-rank", "1", "-n", "1",
                                      "--master-addr", "10.0.0.1", "--master-port", "29500",
                                      "prog"}));
}

TEST(ParseCommandLine, MultiNodeFlags) {
  LaunchOptions o = parse_command_line({"--nnodes", "3", "--node-rank=2", "-n", "2",
                                        "--master-addr", "node0", "--master-port", "29500",
                                        "--no-prefix", "--timeout", "1.5", "prog"})
                        .options;
  EXPECT_EQ(o.nnodes, 3);
  EXPECT_EQ(o.node_rank, 2);
  EXPECT_EQ(o.master_addr, "node0");
  EXPECT_EQ(o.master_port, 29500);
  EXPECT_FALSE(o.prefix_output);
  EXPECT_DOUBLE_EQ(o.timeout_s, 1.5);
  EXPECT_EQ(o.world_size(), 6);
  EXPECT_EQ(o.global_rank(0), 4);
  EXPECT_EQ(o.global_rank(1), 5);
}

TEST(ParseCommandLine, EverythingAfterTheProgramBelongsToIt) {
  Args rest = {"--gtest_filter=Foo.*", "-n", "3", "--no-prefix", "--", "-x", ""};
  Args args = {"-n", "2", "prog"};
  args.insert(args.end(), rest.begin(), rest.end());
  LaunchOptions o = parse_command_line(args).options;
  Args expected = {"prog"};
  expected.insert(expected.end(), rest.begin(), rest.end());
  EXPECT_EQ(o.command, expected);
  EXPECT_EQ(o.nproc_per_node, 2);
  EXPECT_TRUE(o.prefix_output);
}

TEST(ParseCommandLine, DoubleDashMarksTheProgram) {
  LaunchOptions o = parse_command_line({"-n", "2", "--", "-weird-name", "--x"}).options;
  EXPECT_EQ(o.command, (Args{"-weird-name", "--x"}));
  EXPECT_EQ(usage_error({"-n", "2", "--"}).find("missing"), 0u);
}

TEST(ParseCommandLine, HelpIsNotAnError) {
  CommandLine c = parse_command_line({"--help"});
  EXPECT_TRUE(c.help_requested);
  EXPECT_NE(c.help_text.find("--master-port"), std::string::npos);
}

TEST(ParseCommandLine, ErrorsNameOptionValueAndExpectation) {
  struct Case {
    Args args;
    std::vector<std::string> fragments;
  };
  std::vector<Case> cases = {
      {{"-n", "0", "prog"}, {"-n", "positive integer", "'0'"}},
      {{"-n", "abc", "prog"}, {"-n", "positive integer", "'abc'"}},
      {{"-n", "-2", "prog"}, {"-n", "'-2'"}},
      {{"-n", "2x", "prog"}, {"-n", "'2x'"}},
      {{"-n", "99999999999", "prog"}, {"-n", "'99999999999'"}},
      {{"-n", "100000", "prog"}, {"-n must be at most 65536", "'100000'"}},
      {{"-n", " 2", "prog"}, {"-n", "' 2'"}},
      {{"prog"}, {"-n", "required"}},
      {{"-n", "2"}, {"missing", "program"}},
      {{"-n"}, {"-n"}},
      {{"-n", "2", "--bogus", "prog"}, {"unknown option", "'--bogus'"}},
      {{"-n", "2", "--nnodes", "0", "--master-port", "1", "prog"},
       {"--nnodes", "positive integer", "'0'"}},
      {{"-n", "2", "--nnodes", "2", "--node-rank", "3", "--master-port", "29500", "prog"},
       {"--node-rank 3 is out of range for --nnodes 2"}},
      {{"-n", "2", "--node-rank", "1", "prog"}, {"--node-rank 1", "--nnodes 1"}},
      {{"-n", "2", "--nnodes", "2", "--node-rank", "1", "prog"},
       {"--master-port", "required", "--nnodes 2"}},
      {{"-n", "2", "--master-port", "70000", "prog"}, {"--master-port", "65535", "'70000'"}},
      {{"-n", "2", "--master-port", "0", "prog"}, {"--master-port", "'0'"}},
      {{"-n", "2", "--master-addr", "", "prog"}, {"--master-addr", "empty"}},
      {{"-n", "2", "--timeout", "soon", "prog"}, {"--timeout", "seconds", "'soon'"}},
      {{"-n", "2", "--timeout", "-1", "prog"}, {"--timeout", "'-1'"}},
      // Past a year the deadline's nanoseconds would overflow (1e10 s did).
      {{"-n", "2", "--timeout", "1e10", "prog"}, {"--timeout", "at most 31536000", "'1e10'"}},
      {{"-n", "2", "--rdzv-timeout", "1e300", "prog"}, {"--rdzv-timeout", "'1e300'"}},
      {{"-n", "2", "--rdzv-bind", "everywhere", "prog"}, {"--rdzv-bind", "everywhere"}},
      {{"-n", "2", "--nnodes", "2", "--master-port", "1", "--master-addr", "node0.example",
        "prog"},
       {"--master-addr node0.example is not a loopback address", "--rdzv-bind"}},
  };
  for (const Case& c : cases) {
    std::string message = usage_error(c.args);
    for (const std::string& fragment : c.fragments) {
      EXPECT_NE(message.find(fragment), std::string::npos)
          << "args: " << ::testing::PrintToString(c.args) << "\nmessage: " << message
          << "\nmissing: " << fragment;
    }
  }
}

TEST(RankEnvironment, DefinesTheRankAndKeepsTheRest) {
  LaunchOptions o;
  o.nproc_per_node = 4;
  o.nnodes = 2;
  o.node_rank = 1;
  o.master_addr = "node0.cluster";
  o.max_restarts = 3;
  const char* inherited[] = {"PATH=/bin",          "RANK=99", "MASTER_PORT=1",
                             "OMPI_COMM_WORLD_RANK=5", "HOME=/root", nullptr};
  std::vector<std::string> env = rank_environment(o, 29500, 3, 2, inherited);
  auto has = [&env](const std::string& entry) {
    return std::count(env.begin(), env.end(), entry) == 1;
  };
  EXPECT_TRUE(has("PATH=/bin"));
  EXPECT_TRUE(has("HOME=/root"));
  EXPECT_TRUE(has("RANK=7"));
  EXPECT_TRUE(has("WORLD_SIZE=8"));
  EXPECT_TRUE(has("LOCAL_RANK=3"));
  EXPECT_TRUE(has("LOCAL_WORLD_SIZE=4"));
  EXPECT_TRUE(has("MASTER_ADDR=node0.cluster"));
  EXPECT_TRUE(has("MASTER_PORT=29500"));
  EXPECT_TRUE(has("GROUP_RANK=1"));
  EXPECT_TRUE(has("NODE_RANK=1"));
  EXPECT_TRUE(has("TORCHELASTIC_RESTART_COUNT=2"));
  EXPECT_TRUE(has("TORCHELASTIC_MAX_RESTARTS=3"));
  EXPECT_FALSE(has("RANK=99"));
  EXPECT_FALSE(has("MASTER_PORT=1"));
  EXPECT_FALSE(has("OMPI_COMM_WORLD_RANK=5"));
  EXPECT_EQ(env.size(), 12u);
}

// The agents' secret is hprun's: the program (and whatever it logs of its
// environment) never sees it.
TEST(RankEnvironment, DropsTheAgentsSecret) {
  LaunchOptions o;
  o.nproc_per_node = 1;
  const char* inherited[] = {"PATH=/bin", "HPRUN_RDZV_SECRET=s3cret-s3cret-s3cret", nullptr};
  std::vector<std::string> env = rank_environment(o, 29500, 0, 0, inherited);
  for (const std::string& entry : env) EXPECT_EQ(entry.find("HPRUN_RDZV_SECRET"), std::string::npos) << entry;
}

std::string feed_all(LinePrefixer& p, const std::vector<std::string>& chunks) {
  std::string out;
  for (const std::string& c : chunks) p.feed(c.data(), c.size(), &out);
  return out;
}

TEST(LinePrefixer, PrefixesCompleteLinesAcrossChunks) {
  LinePrefixer p("[rank 1] ");
  EXPECT_EQ(feed_all(p, {"ab", "c\nd", "e\n\nf"}), "[rank 1] abc\n[rank 1] de\n[rank 1] \n");
  EXPECT_TRUE(p.has_partial_line());
  std::string out;
  p.finish(&out);
  EXPECT_EQ(out, "[rank 1] f\n");
  out.clear();
  p.finish(&out);
  EXPECT_EQ(out, "");
}

TEST(LinePrefixer, HoldsAPartialLineUntilItEnds) {
  LinePrefixer p("> ");
  EXPECT_EQ(feed_all(p, {"no newline yet"}), "");
  EXPECT_EQ(feed_all(p, {"\n"}), "> no newline yet\n");
  EXPECT_FALSE(p.has_partial_line());
}

TEST(LinePrefixer, CutsLinesLongerThanTheLimit) {
  LinePrefixer p("> ", 4);
  EXPECT_EQ(feed_all(p, {"abcdefghij"}), "> abcd\n> efgh\n");
  EXPECT_EQ(feed_all(p, {"\n"}), "> ij\n");
}

TEST(LinePrefixer, EmptyPrefixStillSplitsLines) {
  LinePrefixer p("");
  EXPECT_EQ(feed_all(p, {"a\nb"}), "a\n");
}

TEST(ExitStatus, DescribesExitsAndSignals) {
  EXPECT_EQ(describe_wait_status(3 << 8), "exited with status 3");
  EXPECT_EQ(exit_code_of(3 << 8), 3);
  EXPECT_EQ(describe_wait_status(SIGKILL), "was killed by signal 9 (SIGKILL)");
  EXPECT_EQ(exit_code_of(SIGKILL), 128 + 9);
  EXPECT_EQ(signal_name(SIGTERM), "SIGTERM");
  EXPECT_EQ(signal_name(64), "signal 64");
}

TEST(ExitStatus, WaitStatusFromSiginfoMatchesWaitpid) {
  pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) ::_exit(7);
  siginfo_t info{};
  ASSERT_EQ(::waitid(P_PID, static_cast<id_t>(pid), &info, WEXITED | WNOWAIT), 0);
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  EXPECT_EQ(wait_status_from(info), status);

  pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    ::pause();
    ::_exit(0);
  }
  ::kill(pid, SIGKILL);
  ASSERT_EQ(::waitid(P_PID, static_cast<id_t>(pid), &info, WEXITED | WNOWAIT), 0);
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  EXPECT_EQ(wait_status_from(info), status);
  EXPECT_EQ(describe_wait_status(wait_status_from(info)), "was killed by signal 9 (SIGKILL)");
}

TEST(FreePort, IsBindableOnLoopback) {
  int port = pick_free_port();
  ASSERT_GT(port, 0);
  ASSERT_LE(port, 65535);
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  EXPECT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0) << "port " << port;
  ::close(fd);
}

TEST(ClockText, MinutesAndSecondsThenHours) {
  EXPECT_EQ(clock_text(0), "00:00");
  EXPECT_EQ(clock_text(41.9), "00:41");
  EXPECT_EQ(clock_text(3599), "59:59");
  EXPECT_EQ(clock_text(3600), "1:00:00");
  EXPECT_EQ(clock_text(36000 + 62), "10:01:02");
}

}  // namespace
}  // namespace hp::launcher
