// hprun across two hosts: two network namespaces joined by a veth pair, one
// hprun per namespace, as a real two-node job (D4). The agents talk over the
// veth only. Needs root (CAP_NET_ADMIN) and iproute2; skipped otherwise.

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <map>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "tests/launcher/process_runner.h"

namespace hp::launcher::testing {
namespace {

using Args = std::vector<std::string>;
using ::testing::HasSubstr;
using ::testing::Not;

std::string find_ip() {
  for (const char* path : {"/usr/sbin/ip", "/sbin/ip", "/usr/bin/ip", "/bin/ip"}) {
    if (::access(path, X_OK) == 0) return path;
  }
  return "";
}

// Two namespaces "<base>a" and "<base>b" holding the two ends of a veth pair,
// 10.213.1.1 and 10.213.1.2 (private, and visible only inside them). Removed
// with everything in them when the object goes away.
class TwoHosts {
 public:
  TwoHosts() : ip_(find_ip()) {
    // The job's secret, shared by both nodes as a real job's would be.
    int fd = ::open(secret_file().c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    if (fd < 0 || ::write(fd, "two-hosts-test-secret\n", 22) != 22) {
      problem_ = "cannot write the job's secret file";
    }
    if (fd >= 0) ::close(fd);
    static std::atomic<int> counter{0};
    base_ = "hp" + std::to_string(::getpid()) + "-" + std::to_string(counter++);
    if (!problem_.empty()) return;
    if (::geteuid() != 0) {
      problem_ = "network namespaces need root";
      return;
    }
    if (ip_.empty()) {
      problem_ = "iproute2's ip is not installed";
      return;
    }
    std::vector<Args> steps = {
        {"netns", "add", ns(0)},
        {"netns", "add", ns(1)},
        {"link", "add", veth(0), "type", "veth", "peer", "name", veth(1)},
    };
    for (int i : {0, 1}) {
      steps.push_back({"link", "set", veth(i), "netns", ns(i)});
      steps.push_back({"-n", ns(i), "addr", "add", address(i) + "/24", "dev", veth(i)});
      steps.push_back({"-n", ns(i), "link", "set", "lo", "up"});
      steps.push_back({"-n", ns(i), "link", "set", veth(i), "up"});
    }
    for (const Args& step : steps) {
      Args argv = {ip_};
      argv.insert(argv.end(), step.begin(), step.end());
      ProcessResult r = run_process(argv);
      if (!(r.exited && r.exit_code == 0)) {
        problem_ = "cannot set up network namespaces ('ip " + step[0] + " " + step[1] +
                   "...' failed: " + r.err + ")";
        return;
      }
    }
  }
  ~TwoHosts() {
    if (ip_.empty()) return;
    // Deleting a namespace deletes the veth end in it, and with it the pair.
    for (int i : {0, 1}) run_process({ip_, "netns", "delete", ns(i)});
    // Left in this namespace only when a setup step failed before moving it.
    run_process({ip_, "link", "delete", veth(0)});
  }

  // Why the hosts could not be made; empty when they are ready.
  const std::string& problem() const { return problem_; }
  std::string ns(int i) const { return base_ + (i == 0 ? "a" : "b"); }
  std::string veth(int i) const { return base_ + (i == 0 ? "v" : "w"); }
  static std::string address(int i) { return i == 0 ? "10.213.1.1" : "10.213.1.2"; }

  std::string secret_file() const { return dir_.file("secret"); }

  // `ip netns exec <ns(i)> hprun --nnodes 2 --node-rank i --master-addr
  // <node 0> --master-port 29400 --rdzv-secret-file <file> <options> sh -c
  // <script>`, node 0 with --rdzv-bind <node 0>. Inside a fresh namespace
  // every port is free.
  Args hprun(int i, const std::string& script, const Args& options) const {
    Args argv = {ip_,          "netns",  "exec",        ns(i),
                 HPRUN_PATH,   "-n",     "2",           "--nnodes",
                 "2",          "--node-rank", std::to_string(i), "--master-addr",
                 address(0),   "--master-port", "29400", "--rdzv-secret-file", secret_file()};
    if (i == 0) argv.insert(argv.end(), {"--rdzv-bind", address(0)});
    argv.insert(argv.end(), options.begin(), options.end());
    argv.insert(argv.end(), {"sh", "-c", script});
    return argv;
  }

 private:
  TempDir dir_;
  std::string ip_;
  std::string base_;
  std::string problem_;
};

#define SKIP_WITHOUT_HOSTS(hosts) \
  if (!(hosts).problem().empty()) GTEST_SKIP() << (hosts).problem()

// Both nodes run `script`; returns {node 0, node 1}.
std::vector<ProcessResult> run_both(const TwoHosts& hosts, const std::string& script,
                                    const Args& options) {
  RunningProcess node0(hosts.hprun(0, script, options));
  ProcessResult node1 = run_process(hosts.hprun(1, script, options), {}, 40);
  return {node0.wait(40), node1};
}

const Args kRestarts = {"--max-restarts", "2", "--rdzv-timeout", "10"};

TEST(HprunTwoHosts, FailureOnNodeOneRestartsBothNodes) {
  TwoHosts hosts;
  SKIP_WITHOUT_HOSTS(hosts);
  TempDir dir;
  // Global rank 3 (node 1) fails in attempt 0 only, once every rank of the
  // attempt has printed.
  std::string script =
      "echo \"attempt=$TORCHELASTIC_RESTART_COUNT port=$MASTER_PORT addr=$MASTER_ADDR\"; "
      "touch " + dir.path() + "/$TORCHELASTIC_RESTART_COUNT.$RANK; "
      "if [ \"$RANK\" = 3 ] && [ \"$TORCHELASTIC_RESTART_COUNT\" = 0 ]; then "
      "while [ $(ls " + dir.path() + " | grep -c '^0\\.') -lt 4 ]; do sleep 0.02; done; "
      "exit 5; fi; "
      "if [ \"$TORCHELASTIC_RESTART_COUNT\" = 0 ]; then sleep 30; fi";
  std::vector<ProcessResult> r = run_both(hosts, script, kRestarts);
  std::regex restart_line(
      "hprun: restart 1/2: rank 3 \\(pid [0-9]+\\) exited with status 5 on node 1 at "
      "00:[0-5][0-9]\n");
  for (int i : {0, 1}) {
    EXPECT_TRUE(r[i].exited && r[i].exit_code == 0) << "node " << i << ": " << describe(r[i]);
    EXPECT_TRUE(std::regex_search(r[i].err, restart_line)) << "node " << i << ": "
                                                            << describe(r[i]);
    EXPECT_THAT(r[i].err, Not(HasSubstr("restart 2/2"))) << describe(r[i]);
    // Every rank of both attempts met at node 0's address.
    for (int attempt : {0, 1}) {
      EXPECT_THAT(r[i].out, HasSubstr("attempt=" + std::to_string(attempt)));
    }
    EXPECT_THAT(r[i].out, Not(HasSubstr("addr=10.213.1.2"))) << describe(r[i]);
  }
  // Both nodes' ranks got the same port per attempt, and a new one for the
  // restart.
  std::regex port_re("\\[rank [0-9]\\] attempt=([01]) port=([0-9]+)");
  std::map<std::string, std::set<std::string>> ports;
  for (int i : {0, 1}) {
    for (std::sregex_iterator it(r[i].out.begin(), r[i].out.end(), port_re), end; it != end;
         ++it) {
      ports[(*it)[1]].insert((*it)[2]);
    }
  }
  ASSERT_EQ(ports["0"].size(), 1u) << describe(r[0]) << describe(r[1]);
  ASSERT_EQ(ports["1"].size(), 1u) << describe(r[0]) << describe(r[1]);
  EXPECT_NE(*ports["0"].begin(), *ports["1"].begin());
  EXPECT_NE(*ports["0"].begin(), "29400") << "the ranks got the agents' port";
}

TEST(HprunTwoHosts, ExhaustedRestartsEndBothNodesWithTheRanksCode) {
  TwoHosts hosts;
  SKIP_WITHOUT_HOSTS(hosts);
  std::string script = "if [ \"$RANK\" = 3 ]; then exit 5; fi; sleep 30";
  std::vector<ProcessResult> r = run_both(hosts, script, kRestarts);
  for (int i : {0, 1}) {
    EXPECT_TRUE(r[i].exited && r[i].exit_code == 5) << "node " << i << ": " << describe(r[i]);
    EXPECT_THAT(r[i].err, HasSubstr("restart 2/2: rank 3")) << describe(r[i]);
    EXPECT_THAT(r[i].err, HasSubstr("hprun: no restarts left: 2 of 2 used")) << describe(r[i]);
    EXPECT_LT(r[i].seconds, 20) << describe(r[i]);
  }
}

// Waits for `path` to exist, at most limit_s.
bool wait_for_file(const std::string& path, double limit_s) {
  double deadline = now_seconds() + limit_s;
  while (::access(path.c_str(), F_OK) != 0) {
    if (now_seconds() > deadline) return false;
    ::usleep(20000);
  }
  return true;
}

// A rank that says it started (dir/started.<rank>), then waits to be ended.
std::string started_then_sleeping(const TempDir& dir) {
  return "touch " + dir.path() + "/started.$RANK; exec sleep 60";
}

// Whether each of the two nodes' four ranks wrote dir/started.<rank> within
// 20 s.
::testing::AssertionResult all_ranks_started(const TempDir& dir) {
  for (int rank = 0; rank < 4; ++rank) {
    if (!wait_for_file(dir.file("started." + std::to_string(rank)), 20)) {
      return ::testing::AssertionFailure() << "rank " << rank << " did not start";
    }
  }
  return ::testing::AssertionSuccess();
}

TEST(HprunTwoHosts, NodeOneKilledEndsTheJobOnNodeZeroWithinTheRendezvousTimeout) {
  TwoHosts hosts;
  SKIP_WITHOUT_HOSTS(hosts);
  TempDir dir;
  const std::string script = started_then_sleeping(dir);
  Args options = {"--max-restarts", "1", "--rdzv-timeout", "3"};
  RunningProcess node0(hosts.hprun(0, script, options));
  RunningProcess node1(hosts.hprun(1, script, options));
  ASSERT_TRUE(all_ranks_started(dir));
  double killed_at = now_seconds();
  ::kill(node1.pid(), SIGKILL);
  ProcessResult r = node0.wait(30);
  ASSERT_FALSE(r.timed_out) << describe(r);
  // The 3 s rendezvous timeout plus the 3 s SIGTERM grace at most.
  EXPECT_LT(now_seconds() - killed_at, 3 + 3 + 2) << describe(r);
  EXPECT_TRUE(r.exited && r.exit_code != 0) << describe(r);
  EXPECT_THAT(r.err, HasSubstr("restart 1/1: node 1 (10.213.1.2) is gone: connection closed"))
      << describe(r);
  EXPECT_THAT(r.err, HasSubstr("hprun: node 1 did not join restart 1 within 3 s")) << describe(r);
  node1.wait(5);
}

// A stopped hprun keeps its connection open (the kernel still answers), so
// only the missing heartbeats tell node 0 that node 1 is gone.
TEST(HprunTwoHosts, SilentNodeIsGoneAfterTheSilenceLimit) {
  TwoHosts hosts;
  SKIP_WITHOUT_HOSTS(hosts);
  TempDir dir;
  const std::string script = started_then_sleeping(dir);
  RunningProcess node0(hosts.hprun(0, script, {}));
  RunningProcess node1(hosts.hprun(1, script, {}));
  ASSERT_TRUE(all_ranks_started(dir));
  double stopped_at = now_seconds();
  ::kill(node1.pid(), SIGSTOP);
  ProcessResult r = node0.wait(40);
  ::kill(node1.pid(), SIGCONT);
  ASSERT_FALSE(r.timed_out) << describe(r);
  // SupervisorConfig's 10 s silence limit, the 3 s SIGTERM grace, 2 s slack.
  EXPECT_LT(now_seconds() - stopped_at, 10 + 3 + 2) << describe(r);
  EXPECT_TRUE(r.exited && r.exit_code == 1) << describe(r);
  EXPECT_THAT(r.err, HasSubstr("hprun: node 1 (10.213.1.2) is gone: no message for 10 s"))
      << describe(r);
  // Resumed, node 1 finds the job ended and ends too.
  ProcessResult r1 = node1.wait(20);
  EXPECT_TRUE(r1.exited && r1.exit_code != 0) << describe(r1);
}

TEST(HprunTwoHosts, NodeZeroKilledEndsTheJobOnNodeOne) {
  TwoHosts hosts;
  SKIP_WITHOUT_HOSTS(hosts);
  TempDir dir;
  const std::string script = started_then_sleeping(dir);
  RunningProcess node0(hosts.hprun(0, script, kRestarts));
  RunningProcess node1(hosts.hprun(1, script, kRestarts));
  ASSERT_TRUE(all_ranks_started(dir));
  ::kill(node0.pid(), SIGKILL);
  ProcessResult r = node1.wait(20);
  ASSERT_FALSE(r.timed_out) << describe(r);
  EXPECT_TRUE(r.exited && r.exit_code == 1) << describe(r);
  EXPECT_THAT(r.err, HasSubstr("hprun: node 0 (10.213.1.1:29400) is gone: connection closed"))
      << describe(r);
  node0.wait(5);
}

TEST(HprunTwoHosts, SigintOnNodeOneEndsBothNodesWithoutARestart) {
  TwoHosts hosts;
  SKIP_WITHOUT_HOSTS(hosts);
  TempDir dir;
  const std::string script = started_then_sleeping(dir);
  RunningProcess node0(hosts.hprun(0, script, kRestarts));
  RunningProcess node1(hosts.hprun(1, script, kRestarts));
  ASSERT_TRUE(all_ranks_started(dir));
  ::kill(node1.pid(), SIGINT);
  ProcessResult r1 = node1.wait(20);
  ProcessResult r0 = node0.wait(20);
  EXPECT_TRUE(r1.exited && r1.exit_code == 128 + SIGINT) << describe(r1);
  EXPECT_TRUE(r0.exited && r0.exit_code == 128 + SIGINT) << describe(r0);
  EXPECT_THAT(r0.err, HasSubstr("received SIGINT on node 1")) << describe(r0);
  EXPECT_THAT(r0.err, Not(HasSubstr("restart 1/"))) << describe(r0);
}

}  // namespace
}  // namespace hp::launcher::testing
