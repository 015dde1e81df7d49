// End-to-end tests of the hprun binary: real ranks (small sh scripts), real
// signals, real pipes. Time is asserted only as generous upper bounds.

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <regex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "tests/launcher/process_runner.h"
#include "tools/hprun/free_port.h"

namespace hp::launcher::testing {
namespace {

using Args = std::vector<std::string>;

Args hprun(Args args) {
  args.insert(args.begin(), HPRUN_PATH);
  return args;
}

// hprun -n <n> [extra options] sh -c <script>
Args hprun_sh(int n, const std::string& script, Args options = {}) {
  Args args = {"-n", std::to_string(n)};
  args.insert(args.end(), options.begin(), options.end());
  args.insert(args.end(), {"sh", "-c", script});
  return hprun(args);
}

std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

using ::testing::HasSubstr;
using ::testing::Not;

// Every pid is gone within `limit_s` (killed processes may need a moment).
void expect_all_dead(const std::vector<long>& pids, double limit_s = 3) {
  double deadline = now_seconds() + limit_s;
  for (long pid : pids) {
    ASSERT_GT(pid, 0);
    while (process_alive(static_cast<pid_t>(pid)) && now_seconds() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    EXPECT_FALSE(process_alive(static_cast<pid_t>(pid))) << "pid " << pid << " survived";
  }
}

// Every rank writes its shell's pid to <dir>/leader.<rank> and the pid of a
// background child to <dir>/child.<rank>, then waits. Returns all pids once
// every rank has written them.
std::string pid_writing_script(const TempDir& dir, const std::string& before_wait = "") {
  return "sleep 60 & echo $! > " + dir.path() + "/child.$RANK; " + before_wait + "echo $$ > " +
         dir.path() + "/leader.$RANK; wait";
}

std::vector<long> wait_for_pids(const TempDir& dir, int ranks) {
  std::vector<long> pids;
  for (int r = 0; r < ranks; ++r) {
    for (const char* kind : {"leader.", "child."}) {
      pids.push_back(wait_for_integer_file(dir.file(kind + std::to_string(r)), 10));
    }
  }
  return pids;
}

// hprun on `ranks` ranks that each start a background child and wait
// (after `before_wait`), with every pid once all have started.
struct WaitingRanks {
  explicit WaitingRanks(int ranks, const std::string& before_wait = "")
      : process(hprun_sh(ranks, pid_writing_script(dir, before_wait))),
        pids(wait_for_pids(dir, ranks)) {}
  bool started() const {
    return std::all_of(pids.begin(), pids.end(), [](long pid) { return pid > 0; });
  }
  TempDir dir;
  RunningProcess process;
  std::vector<long> pids;
};

TEST(Hprun, AllRanksSucceedingExitsZero) {
  ProcessResult r = run_process(hprun({"-n", "4", "true"}));
  EXPECT_TRUE(r.exited && r.exit_code == 0) << describe(r);
  EXPECT_EQ(r.out, "");
  EXPECT_EQ(r.err, "");
}

TEST(Hprun, FailingRankIsReportedAndTheOthersTerminated) {
  ProcessResult r =
      run_process(hprun_sh(4, "if [ \"$RANK\" = 1 ]; then echo dying >&2; exit 3; fi; sleep 60"));
  ASSERT_FALSE(r.timed_out) << describe(r);
  EXPECT_LT(r.seconds, 10) << describe(r);
  EXPECT_TRUE(r.exited && r.exit_code == 3) << describe(r);
  EXPECT_TRUE(std::regex_search(r.err, std::regex("hprun: rank 1 \\(pid [0-9]+\\) exited with "
                                                  "status 3\n")))
      << describe(r);
  // The rank's own last words come before the verdict.
  EXPECT_LT(r.err.find("[rank 1] dying"), r.err.find("hprun: rank 1")) << describe(r);
  // Ranks killed by the teardown are not reported as failures.
  for (const char* other : {"rank 0 (pid", "rank 2 (pid", "rank 3 (pid"}) {
    EXPECT_THAT(r.err, Not(HasSubstr(other))) << describe(r);
  }
}

TEST(Hprun, RankKilledBySignalIsReported) {
  ProcessResult r = run_process(hprun_sh(3, "if [ \"$RANK\" = 2 ]; then kill -9 $$; fi; sleep 60"));
  ASSERT_FALSE(r.timed_out) << describe(r);
  EXPECT_LT(r.seconds, 10) << describe(r);
  EXPECT_TRUE(r.exited && r.exit_code == 128 + 9) << describe(r);
  EXPECT_THAT(r.err, HasSubstr("rank 2 (pid ")) << describe(r);
  EXPECT_THAT(r.err, HasSubstr("was killed by signal 9 (SIGKILL)")) << describe(r);
}

TEST(Hprun, RanksIgnoringSigtermAreKilled) {
  TempDir dir;
  // Ranks other than 1 ignore SIGTERM (so does their background child).
  // Rank 1 fails once they are set up.
  std::string script = "if [ \"$RANK\" = 1 ]; then while [ ! -s " + dir.file("leader.0") +
                       " ] || [ ! -s " + dir.file("leader.2") +
                       " ]; do sleep 0.05; done; exit 5; fi; trap '' TERM; " +
                       pid_writing_script(dir);
  RunningProcess process(hprun_sh(3, script));
  ProcessResult r = process.wait(20);
  ASSERT_FALSE(r.timed_out) << describe(r);
  EXPECT_LT(r.seconds, 10) << describe(r);
  EXPECT_TRUE(r.exited && r.exit_code == 5) << describe(r);
  EXPECT_THAT(r.err, HasSubstr("rank 1 (pid ")) << describe(r);
  EXPECT_THAT(r.err, HasSubstr("sending SIGKILL")) << describe(r);
  std::vector<long> pids;
  for (int rank : {0, 2}) {
    for (const char* kind : {"leader.", "child."}) {
      pids.push_back(wait_for_integer_file(dir.file(kind + std::to_string(rank)), 1));
    }
  }
  expect_all_dead(pids);
}

std::map<std::string, std::string> parse_assignments(const std::string& line) {
  std::map<std::string, std::string> values;
  std::istringstream in(line);
  for (std::string word; in >> word;) {
    auto eq = word.find('=');
    if (eq != std::string::npos) values[word.substr(0, eq)] = word.substr(eq + 1);
  }
  return values;
}

const char* kPrintEnv =
    "echo \"RANK=$RANK WORLD_SIZE=$WORLD_SIZE LOCAL_RANK=$LOCAL_RANK "
    "LOCAL_WORLD_SIZE=$LOCAL_WORLD_SIZE MASTER_ADDR=$MASTER_ADDR MASTER_PORT=$MASTER_PORT "
    "GROUP_RANK=$GROUP_RANK NODE_RANK=$NODE_RANK MARKER=$HPRUN_TEST_MARKER\"";

// Rank -> its variables, from lines "[rank r] NAME=value ...".
std::map<int, std::map<std::string, std::string>> env_by_rank(const std::string& out) {
  std::map<int, std::map<std::string, std::string>> result;
  std::regex line_re("\\[rank ([0-9]+)\\] (.*)");
  for (const std::string& line : lines_of(out)) {
    std::smatch m;
    EXPECT_TRUE(std::regex_match(line, m, line_re)) << "unprefixed line: " << line;
    if (m.empty()) continue;
    int rank = std::stoi(m[1]);
    EXPECT_EQ(result.count(rank), 0u) << "rank " << rank << " printed twice";
    result[rank] = parse_assignments(m[2]);
  }
  return result;
}

TEST(Hprun, EnvironmentDescribesEachRank) {
  // Stale values in hprun's own environment must not reach the ranks.
  ProcessResult r = run_process(hprun_sh(3, kPrintEnv),
                                {"RANK=99", "MASTER_PORT=1", "HPRUN_TEST_MARKER=inherited"});
  ASSERT_TRUE(r.exited && r.exit_code == 0) << describe(r);
  auto env = env_by_rank(r.out);
  ASSERT_EQ(env.size(), 3u) << describe(r);
  std::string port = env[0]["MASTER_PORT"];
  for (int rank = 0; rank < 3; ++rank) {
    auto& v = env[rank];
    EXPECT_EQ(v["RANK"], std::to_string(rank));
    EXPECT_EQ(v["WORLD_SIZE"], "3");
    EXPECT_EQ(v["LOCAL_RANK"], std::to_string(rank));
    EXPECT_EQ(v["LOCAL_WORLD_SIZE"], "3");
    EXPECT_EQ(v["MASTER_ADDR"], "127.0.0.1");
    EXPECT_EQ(v["MASTER_PORT"], port) << "ranks disagree on the port";
    EXPECT_EQ(v["GROUP_RANK"], "0");
    EXPECT_EQ(v["NODE_RANK"], "0");
    EXPECT_EQ(v["MARKER"], "inherited");
  }
  ASSERT_TRUE(std::regex_match(port, std::regex("[0-9]{1,5}"))) << port;
  EXPECT_GT(std::stoi(port), 1);
  EXPECT_LE(std::stoi(port), 65535);
}

TEST(Hprun, GivenMasterPortIsPassedThrough) {
  ProcessResult r = run_process(hprun_sh(2, kPrintEnv, {"--master-port", "29555"}));
  ASSERT_TRUE(r.exited && r.exit_code == 0) << describe(r);
  auto env = env_by_rank(r.out);
  ASSERT_EQ(env.size(), 2u) << describe(r);
  EXPECT_EQ(env[0]["MASTER_PORT"], "29555");
  EXPECT_EQ(env[1]["MASTER_PORT"], "29555");
}

// The agents' secret of the multi-node tests on loopback (agent_protocol.h).
const std::vector<std::string> kLoopbackSecretEnv = {"HPRUN_RDZV_SECRET=loopback-test-secret"};

// Two nodes on loopback: node 1's ranks come after node 0's and meet at the
// ranks' port node 0's agent picked, not at the agents' own --master-port.
TEST(Hprun, MultiNodeFlagsOffsetGlobalRanks) {
  const std::string agents_port = std::to_string(pick_free_port());
  auto node = [&](int rank) {
    return hprun_sh(2, kPrintEnv,
                    {"--nnodes", "2", "--node-rank", std::to_string(rank), "--master-port",
                     agents_port, "--rdzv-timeout", "20"});
  };
  RunningProcess node0(node(0), kLoopbackSecretEnv);
  ProcessResult r1 = run_process(node(1), kLoopbackSecretEnv);
  ProcessResult r0 = node0.wait(30);
  ASSERT_TRUE(r0.exited && r0.exit_code == 0) << describe(r0);
  ASSERT_TRUE(r1.exited && r1.exit_code == 0) << describe(r1);
  auto env0 = env_by_rank(r0.out);
  auto env = env_by_rank(r1.out);
  ASSERT_EQ(env0.size(), 2u) << describe(r0);
  ASSERT_EQ(env.size(), 2u) << describe(r1);
  const std::string ranks_port = env0[0]["MASTER_PORT"];
  EXPECT_NE(ranks_port, agents_port);
  for (int local = 0; local < 2; ++local) {
    auto& v = env[2 + local];  // keyed by the prefix, i.e. the global rank
    EXPECT_EQ(v["RANK"], std::to_string(2 + local)) << describe(r1);
    EXPECT_EQ(v["WORLD_SIZE"], "4");
    EXPECT_EQ(v["LOCAL_RANK"], std::to_string(local));
    EXPECT_EQ(v["LOCAL_WORLD_SIZE"], "2");
    EXPECT_EQ(v["GROUP_RANK"], "1");
    EXPECT_EQ(v["NODE_RANK"], "1");
    EXPECT_EQ(v["MASTER_PORT"], ranks_port);
    EXPECT_EQ(env0[local]["MASTER_PORT"], ranks_port);
  }
}

// Node 0 turns away a node whose world differs from its own, and gives up
// on the missing node after --rdzv-timeout.
TEST(Hprun, NodeWithOtherFlagsIsTurnedAway) {
  const std::string agents_port = std::to_string(pick_free_port());
  Args common = {"--nnodes", "2", "--master-port", agents_port, "--rdzv-timeout", "2"};
  auto node = [&](int rank, int n) {
    Args options = common;
    options.insert(options.end(), {"--node-rank", std::to_string(rank)});
    return hprun_sh(n, "true", options);
  };
  RunningProcess node0(node(0, 2), kLoopbackSecretEnv);
  ProcessResult r1 = run_process(node(1, 3), kLoopbackSecretEnv);
  ProcessResult r0 = node0.wait(30);
  EXPECT_TRUE(r1.exited && r1.exit_code == 2) << describe(r1);
  EXPECT_THAT(r1.err, HasSubstr("node 1 (127.0.0.1) was started with --nnodes 2 -n 3 "
                                "--max-restarts 0, node 0 with --nnodes 2 -n 2 --max-restarts 0"))
      << describe(r1);
  EXPECT_TRUE(r0.exited && r0.exit_code == 1) << describe(r0);
  EXPECT_THAT(r0.err, HasSubstr("hprun: node 1 did not join the job within 2 s")) << describe(r0);
}

TEST(Hprun, LinesStayWholeAndNothingIsLost) {
  constexpr int kRanks = 3, kOutLines = 3000, kErrLines = 1000, kLongLine = 200000;
  std::string script =
      "seq 1 " + std::to_string(kOutLines) + " | sed \"s/^/r$RANK-/\"; "
      "seq 1 " + std::to_string(kErrLines) + " | sed \"s/^/e$RANK-/\" >&2; "
      "head -c " + std::to_string(kLongLine) + " /dev/zero | tr '\\0' x; echo; "
      "printf \"tail-$RANK\"; printf \"err-tail-$RANK\" >&2";
  ProcessResult r = run_process(hprun_sh(kRanks, script));
  ASSERT_TRUE(r.exited && r.exit_code == 0) << r.err.substr(0, 2000);

  for (bool is_err : {false, true}) {
    std::map<int, std::vector<std::string>> per_rank;
    for (const std::string& line : lines_of(is_err ? r.err : r.out)) {
      // Not std::regex: libstdc++'s recursion overflows the stack on the
      // 200 kB line.
      ASSERT_TRUE(line.size() >= 9 && line.compare(0, 6, "[rank ") == 0 &&
                  line.compare(7, 2, "] ") == 0 && line[6] >= '0' && line[6] < '0' + kRanks)
          << "bad line: " << line.substr(0, 200);
      per_rank[line[6] - '0'].push_back(line.substr(9));
    }
    ASSERT_EQ(per_rank.size(), static_cast<size_t>(kRanks));
    for (auto& [rank, lines] : per_rank) {
      std::string tag = std::string(is_err ? "e" : "r") + std::to_string(rank) + "-";
      int count = is_err ? kErrLines : kOutLines;
      std::vector<std::string> expected;
      for (int i = 1; i <= count; ++i) expected.push_back(tag + std::to_string(i));
      if (!is_err) expected.push_back(std::string(kLongLine, 'x'));
      expected.push_back((is_err ? "err-tail-" : "tail-") + std::to_string(rank));
      ASSERT_EQ(lines.size(), expected.size()) << "rank " << rank << (is_err ? " stderr" : "");
      for (size_t i = 0; i < lines.size(); ++i) {
        ASSERT_EQ(lines[i], expected[i]) << "rank " << rank << " line " << i;
      }
    }
  }
}

TEST(Hprun, ArgumentsAfterTheProgramPassThroughUnchanged) {
  Args program_args = {"--gtest_filter=Foo.*:Bar.*", "-n", "3", "--no-prefix",
                       "--master-port=1", "two words", "", "--"};
  Args args = {"-n", "1", "sh", "-c", "for a in \"$@\"; do echo \"<$a>\"; done", "sh"};
  args.insert(args.end(), program_args.begin(), program_args.end());
  ProcessResult r = run_process(hprun(args));
  ASSERT_TRUE(r.exited && r.exit_code == 0) << describe(r);
  std::vector<std::string> expected;
  for (const std::string& a : program_args) expected.push_back("[rank 0] <" + a + ">");
  EXPECT_EQ(lines_of(r.out), expected);
}

TEST(Hprun, NoPrefixLeavesLinesBare) {
  ProcessResult r = run_process(hprun({"--no-prefix", "-n", "2", "echo", "hello"}));
  ASSERT_TRUE(r.exited && r.exit_code == 0) << describe(r);
  EXPECT_EQ(r.out, "hello\nhello\n");
}

TEST(Hprun, UsageErrorsExitTwoBeforeStartingAnything) {
  TempDir dir;
  std::string marker = dir.file("started");
  Args program = {"sh", "-c", "touch " + marker};
  struct Case {
    Args options;
    std::vector<std::string> fragments;
    bool with_program = true;
  };
  std::vector<Case> cases = {
      {{"-n", "0"}, {"-n", "'0'", "positive integer"}},
      {{"-n", "many"}, {"-n", "'many'"}},
      {{"-n", "2"}, {"missing", "program"}, false},
      {{"-n", "2", "--nnodes", "2", "--node-rank", "3", "--master-port", "29500"},
       {"--node-rank 3", "--nnodes 2"}},
      {{"-n", "2", "--nnodes", "2", "--node-rank", "1"}, {"--master-port", "--nnodes 2"}},
      {{"-n", "2", "--master-port", "65536"}, {"--master-port", "'65536'"}},
      {{"-n", "2", "--frobnicate"}, {"'--frobnicate'"}},
      // Plain decimals only: CLI11's own conversion would read 0x10 as 16.
      {{"-n", "0x10"}, {"-n must be a positive integer, got '0x10'"}},
      {{"-n", "99999999999999999999"}, {"must be at most 65536, got '99999999999999999999'"}},
      {{"-n", "2", "--timeout", "0"},
       {"--timeout must be a positive number of seconds, at most 31536000 (a year), got '0'"}},
      // 1e10 s would overflow the clock's nanoseconds when added to now.
      {{"-n", "2", "--timeout", "1e10"}, {"--timeout", "at most 31536000", "'1e10'"}},
      {{"-n", "2", "--nnodes", "2", "--master-port", "29500", "--master-addr", "10.1.2.3"},
       {"--master-addr 10.1.2.3 is not a loopback address", "--rdzv-bind"}},
      {{"-n", "2", "--timeout", "inf"}, {"--timeout", "'inf'"}},
  };
  for (const Case& c : cases) {
    Args args = c.options;
    if (c.with_program) args.insert(args.end(), program.begin(), program.end());
    ProcessResult r = run_process(hprun(args));
    EXPECT_TRUE(r.exited && r.exit_code == 2) << describe(r);
    EXPECT_THAT(r.err, HasSubstr("hprun: ")) << describe(r);
    for (const std::string& fragment : c.fragments) {
      EXPECT_THAT(r.err, HasSubstr(fragment)) << "missing '" << fragment << "'\n" << describe(r);
    }
  }
  EXPECT_NE(::access(marker.c_str(), F_OK), 0) << "a usage error still started the program";
}

TEST(Hprun, ProgramThatCannotBeExecutedFailsTheJob) {
  ProcessResult r = run_process(hprun({"-n", "2", "hprun-test-no-such-program", "--flag"}));
  ASSERT_FALSE(r.timed_out) << describe(r);
  EXPECT_TRUE(r.exited && r.exit_code == 127) << describe(r);
  EXPECT_THAT(r.err, HasSubstr("cannot execute 'hprun-test-no-such-program': No such file"))
      << describe(r);
  EXPECT_TRUE(std::regex_search(r.err, std::regex("rank [01] \\(pid [0-9]+\\) exited with "
                                                  "status 127")))
      << describe(r);
}

TEST(Hprun, SigtermIsForwardedAndNoProcessSurvives) {
  WaitingRanks job(3);
  ASSERT_TRUE(job.started()) << "ranks did not start";
  ::kill(job.process.pid(), SIGTERM);
  ProcessResult r = job.process.wait(20);
  ASSERT_FALSE(r.timed_out) << describe(r);
  EXPECT_TRUE(r.exited && r.exit_code != 0) << describe(r);
  EXPECT_THAT(r.err, HasSubstr("received SIGTERM")) << describe(r);
  expect_all_dead(job.pids);
}

TEST(Hprun, RanksThatHandleTheForwardedSignalCanEndCleanly) {
  WaitingRanks job(2, "trap 'exit 0' TERM; ");
  ASSERT_TRUE(job.started()) << "ranks did not start";
  ::kill(job.process.pid(), SIGTERM);
  ProcessResult r = job.process.wait(20);
  ASSERT_FALSE(r.timed_out) << describe(r);
  EXPECT_LT(r.seconds, 10) << describe(r);
  EXPECT_TRUE(r.exited && r.exit_code == 0) << describe(r);
  expect_all_dead(job.pids);
}

TEST(Hprun, SecondSigintEscalatesToSigkill) {
  // The ranks ignore SIGINT, so only the escalation can stop them.
  WaitingRanks job(2, "trap '' INT; ");
  ASSERT_TRUE(job.started()) << "ranks did not start";
  ::kill(job.process.pid(), SIGINT);
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  double second = now_seconds();
  ::kill(job.process.pid(), SIGINT);
  ProcessResult r = job.process.wait(20);
  ASSERT_FALSE(r.timed_out) << describe(r);
  EXPECT_TRUE(r.exited && r.exit_code == 128 + SIGINT) << describe(r);
  EXPECT_THAT(r.err, HasSubstr("sending SIGKILL")) << describe(r);
  // Well inside the 3 s SIGTERM grace: the second signal did the killing.
  EXPECT_LT(now_seconds() - second, 2.5) << describe(r);
  expect_all_dead(job.pids);
}

// The grace message names the signal hprun forwarded, not always SIGTERM.
TEST(Hprun, ForwardedSigintIsNamedWhenItsGraceRunsOut) {
  // The ranks ignore SIGINT: only the SIGKILL after the 3 s grace stops them.
  WaitingRanks job(2, "trap '' INT; ");
  ASSERT_TRUE(job.started()) << "ranks did not start";
  ::kill(job.process.pid(), SIGINT);
  ProcessResult r = job.process.wait(20);
  ASSERT_FALSE(r.timed_out) << describe(r);
  EXPECT_TRUE(r.exited && r.exit_code == 128 + SIGINT) << describe(r);
  EXPECT_THAT(r.err, HasSubstr("received SIGINT; forwarding it to 2 ranks")) << describe(r);
  EXPECT_THAT(r.err, HasSubstr("still running 3 s after SIGINT; sending SIGKILL")) << describe(r);
  EXPECT_THAT(r.err, Not(HasSubstr("after SIGTERM"))) << describe(r);
  expect_all_dead(job.pids);
}

TEST(Hprun, HelpGivesTimeoutsDefaultAndExitStatus) {
  ProcessResult r = run_process(hprun({"--help"}));
  ASSERT_TRUE(r.exited && r.exit_code == 0) << describe(r);
  EXPECT_THAT(r.out, HasSubstr("exit with status 124")) << describe(r);
  EXPECT_THAT(r.out, HasSubstr("(default: no limit)")) << describe(r);
}

TEST(Hprun, RanksDieWithAKilledHprun) {
  TempDir dir;
  // exec: the rank's only process is the one PR_SET_PDEATHSIG covers.
  RunningProcess process(
      hprun_sh(2, "echo $$ > " + dir.path() + "/leader.$RANK; exec sleep 60"));
  std::vector<long> pids;
  for (int r = 0; r < 2; ++r) {
    pids.push_back(wait_for_integer_file(dir.file("leader." + std::to_string(r)), 10));
    ASSERT_GT(pids.back(), 0) << "ranks did not start";
  }
  ::kill(process.pid(), SIGKILL);
  ProcessResult r = process.wait(20);
  EXPECT_EQ(r.term_signal, SIGKILL) << describe(r);
  expect_all_dead(pids);
}

TEST(Hprun, TimeoutEndsTheJob) {
  ProcessResult r = run_process(hprun({"--timeout", "1", "-n", "2", "sleep", "30"}));
  ASSERT_FALSE(r.timed_out) << describe(r);
  EXPECT_LT(r.seconds, 10) << describe(r);
  EXPECT_TRUE(r.exited && r.exit_code == 124) << describe(r);
  EXPECT_THAT(r.err, HasSubstr("--timeout 1 s")) << describe(r);
}

// --- Restarts (--max-restarts) ---

// Each rank prints the attempt it belongs to:
// "[rank r] attempt=<TORCHELASTIC_RESTART_COUNT> max=<..._MAX_RESTARTS> port=<MASTER_PORT>",
// then waits until all `ranks` of its attempt have, so that no rank is torn
// down before it printed.
std::string print_attempt(const TempDir& dir, int ranks) {
  return "echo \"attempt=$TORCHELASTIC_RESTART_COUNT max=$TORCHELASTIC_MAX_RESTARTS "
         "port=$MASTER_PORT\"; touch " + dir.path() + "/$TORCHELASTIC_RESTART_COUNT.$RANK; "
         "while [ $(ls " + dir.path() + " | grep -c \"^$TORCHELASTIC_RESTART_COUNT\\.\") -lt " +
         std::to_string(ranks) + " ]; do sleep 0.02; done; ";
}

// (rank, attempt) -> MASTER_PORT, from the lines print_attempt wrote.
std::map<std::pair<int, int>, std::string> ports_by_attempt(const std::string& out,
                                                            const std::string& max) {
  std::map<std::pair<int, int>, std::string> result;
  std::regex line_re("\\[rank ([0-9]+)\\] attempt=([0-9]+) max=([0-9]*) port=([0-9]+)");
  for (const std::string& line : lines_of(out)) {
    std::smatch m;
    if (!std::regex_match(line, m, line_re)) continue;
    EXPECT_EQ(m[3].str(), max) << line;
    result[{std::stoi(m[1]), std::stoi(m[2])}] = m[4];
  }
  return result;
}

std::size_t count_of(const std::string& text, const std::string& what) {
  std::size_t n = 0;
  for (auto at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

TEST(HprunRestart, FailedAttemptsAreRestartedUntilOneSucceeds) {
  TempDir dir;
  // Rank 1 fails in attempts 0 and 1; attempt 2 succeeds.
  std::string script = print_attempt(dir, 2) +
                       "if [ \"$RANK\" = 1 ] && [ \"$TORCHELASTIC_RESTART_COUNT\" -lt 2 ]; then "
                       "exit 3; fi";
  ProcessResult r = run_process(hprun_sh(2, script, {"--max-restarts", "3"}));
  ASSERT_FALSE(r.timed_out) << describe(r);
  EXPECT_TRUE(r.exited && r.exit_code == 0) << describe(r);
  for (int k : {1, 2}) {
    EXPECT_TRUE(std::regex_search(
        r.err, std::regex("hprun: restart " + std::to_string(k) +
                          "/3: rank 1 \\(pid [0-9]+\\) exited with status 3 at 00:[0-5][0-9]\n")))
        << describe(r);
  }
  EXPECT_THAT(r.err, Not(HasSubstr("restart 3/3"))) << describe(r);
  auto ports = ports_by_attempt(r.out, "3");
  for (int rank : {0, 1}) {
    for (int attempt : {0, 1, 2}) {
      EXPECT_EQ(ports.count({rank, attempt}), 1u)
          << "rank " << rank << " attempt " << attempt << "\n" << describe(r);
    }
  }
  EXPECT_EQ(ports.size(), 6u) << describe(r);
}

TEST(HprunRestart, EveryAttemptGetsAFreshRendezvousPort) {
  TempDir dir;
  std::string script = print_attempt(dir, 2) +
                       "if [ \"$TORCHELASTIC_RESTART_COUNT\" -lt 2 ]; then exit 1; fi";
  ProcessResult r = run_process(hprun_sh(2, script, {"--max-restarts", "2"}));
  ASSERT_TRUE(r.exited && r.exit_code == 0) << describe(r);
  auto ports = ports_by_attempt(r.out, "2");
  ASSERT_EQ(ports.size(), 6u) << describe(r);
  for (int attempt : {0, 1, 2}) {
    EXPECT_EQ((ports[{0, attempt}]), (ports[{1, attempt}])) << "ranks of one attempt disagree";
  }
  EXPECT_NE((ports[{0, 0}]), (ports[{0, 1}])) << describe(r);
  EXPECT_NE((ports[{0, 1}]), (ports[{0, 2}])) << describe(r);
  EXPECT_NE((ports[{0, 0}]), (ports[{0, 2}])) << describe(r);
}

TEST(HprunRestart, GivenMasterPortIsKeptAcrossAttempts) {
  TempDir dir;
  std::string script = print_attempt(dir, 1) +
                       "if [ \"$TORCHELASTIC_RESTART_COUNT\" = 0 ]; then exit 1; fi";
  ProcessResult r =
      run_process(hprun_sh(1, script, {"--max-restarts", "1", "--master-port", "29557"}));
  ASSERT_TRUE(r.exited && r.exit_code == 0) << describe(r);
  auto ports = ports_by_attempt(r.out, "1");
  ASSERT_EQ(ports.size(), 2u) << describe(r);
  EXPECT_EQ((ports[{0, 0}]), "29557");
  EXPECT_EQ((ports[{0, 1}]), "29557");
}

TEST(HprunRestart, ExhaustedRestartsExitWithTheLastFailure) {
  TempDir dir;
  std::string script = print_attempt(dir, 2) +
                       "if [ \"$RANK\" = 1 ]; then exit $((TORCHELASTIC_RESTART_COUNT + 5)); fi; "
                       "sleep 60";
  ProcessResult r = run_process(hprun_sh(2, script, {"--max-restarts", "2"}));
  ASSERT_FALSE(r.timed_out) << describe(r);
  EXPECT_LT(r.seconds, 20) << describe(r);
  // Attempt 2, the last, failed with 5 + 2.
  EXPECT_TRUE(r.exited && r.exit_code == 7) << describe(r);
  EXPECT_THAT(r.err, HasSubstr("restart 1/2: rank 1")) << describe(r);
  EXPECT_THAT(r.err, HasSubstr("restart 2/2: rank 1")) << describe(r);
  EXPECT_THAT(r.err, HasSubstr("hprun: no restarts left: 2 of 2 used\n")) << describe(r);
  EXPECT_EQ(count_of(r.err, "hprun: restart "), 2u) << describe(r);
  EXPECT_EQ(ports_by_attempt(r.out, "2").size(), 6u) << describe(r);
}

TEST(HprunRestart, NoRestartsByDefault) {
  TempDir dir;
  std::string script = print_attempt(dir, 2) + "if [ \"$RANK\" = 1 ]; then exit 3; fi";
  ProcessResult r = run_process(hprun_sh(2, script));
  EXPECT_TRUE(r.exited && r.exit_code == 3) << describe(r);
  EXPECT_THAT(r.err, Not(HasSubstr("restart"))) << describe(r);
  EXPECT_EQ(ports_by_attempt(r.out, "0").size(), 2u) << describe(r);
}

TEST(HprunRestart, RankKilledBySignalIsRestarted) {
  TempDir dir;
  std::string script = print_attempt(dir, 3) +
                       "if [ \"$RANK\" = 2 ] && [ \"$TORCHELASTIC_RESTART_COUNT\" = 0 ]; then "
                       "kill -9 $$; fi";
  ProcessResult r = run_process(hprun_sh(3, script, {"--max-restarts", "1"}));
  ASSERT_FALSE(r.timed_out) << describe(r);
  EXPECT_TRUE(r.exited && r.exit_code == 0) << describe(r);
  EXPECT_TRUE(std::regex_search(
      r.err, std::regex("hprun: restart 1/1: rank 2 \\(pid [0-9]+\\) was killed by signal 9 "
                        "\\(SIGKILL\\) at 00:[0-5][0-9]\n")))
      << describe(r);
  EXPECT_EQ(ports_by_attempt(r.out, "1").count({2, 1}), 1u) << describe(r);
}

TEST(HprunRestart, SigintDuringARestartedAttemptEndsEverything) {
  TempDir dir;
  // Attempt 0: rank 1 fails. Attempt 1: every rank writes its pids and waits.
  std::string script = "if [ \"$TORCHELASTIC_RESTART_COUNT\" = 0 ]; then "
                       "if [ \"$RANK\" = 1 ]; then exit 3; fi; sleep 60; fi; " +
                       pid_writing_script(dir);
  RunningProcess process(hprun_sh(2, script, {"--max-restarts", "5"}));
  std::vector<long> pids = wait_for_pids(dir, 2);
  for (long pid : pids) ASSERT_GT(pid, 0) << "attempt 1 did not start";
  ::kill(process.pid(), SIGINT);
  ProcessResult r = process.wait(20);
  ASSERT_FALSE(r.timed_out) << describe(r);
  EXPECT_LT(r.seconds, 15) << describe(r);
  EXPECT_TRUE(r.exited && r.exit_code == 128 + SIGINT) << describe(r);
  EXPECT_THAT(r.err, HasSubstr("restart 1/5")) << describe(r);
  EXPECT_THAT(r.err, HasSubstr("received SIGINT")) << describe(r);
  EXPECT_THAT(r.err, Not(HasSubstr("restart 2/5"))) << describe(r);
  expect_all_dead(pids);
}

TEST(HprunRestart, TimeoutSpansAllAttempts) {
  // Every attempt fails after 0.3 s; only a deadline across attempts ends
  // the 100 restarts (30 s) within 2 s.
  ProcessResult r = run_process(
      hprun_sh(2, "sleep 0.3; exit 1", {"--max-restarts", "100", "--timeout", "2"}));
  ASSERT_FALSE(r.timed_out) << describe(r);
  EXPECT_LT(r.seconds, 10) << describe(r);
  EXPECT_TRUE(r.exited && r.exit_code == 124) << describe(r);
  EXPECT_THAT(r.err, HasSubstr("restart 1/100")) << describe(r);
  EXPECT_THAT(r.err, HasSubstr("--timeout 2 s")) << describe(r);
  EXPECT_THAT(r.err, Not(HasSubstr("no restarts left"))) << describe(r);
}

TEST(HprunRestart, UsageErrors) {
  for (const Args& options : {Args{"--max-restarts", "-1"}, Args{"--max-restarts", "x"},
                              Args{"--rdzv-timeout", "0"}}) {
    Args args = {"-n", "1"};
    args.insert(args.end(), options.begin(), options.end());
    args.push_back("true");
    ProcessResult r = run_process(hprun(args));
    EXPECT_TRUE(r.exited && r.exit_code == 2) << describe(r);
    EXPECT_THAT(r.err, HasSubstr(options[0])) << describe(r);
    EXPECT_THAT(r.err, HasSubstr("'" + options[1] + "'")) << describe(r);
  }
}

}  // namespace
}  // namespace hp::launcher::testing
