// hprun's agents facing strangers on loopback: a test plays the stranger
// (or an impostor node 0) over a plain socket against real hprun agents.
// What the agents trust and what they do not: README, "Several nodes".

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "tests/launcher/process_runner.h"
#include "tools/hprun/agent_protocol.h"
#include "tools/hprun/free_port.h"
#include "tools/hprun/sha256.h"

namespace hp::launcher::testing {
namespace {

using Args = std::vector<std::string>;
using ::testing::HasSubstr;
using ::testing::Not;

const std::string kSecuritySecret = "security-test-secret";
const std::vector<std::string> kSecuritySecretEnv = {"HPRUN_RDZV_SECRET=" + kSecuritySecret};

// hprun as node `node` of two on loopback, one rank running `script`.
Args agent(int node, int port, const std::string& script, const char* rdzv_timeout = "20") {
  Args args = {HPRUN_PATH,    "-n", "1", "--nnodes", "2", "--node-rank", std::to_string(node),
               "--master-port", std::to_string(port), "--rdzv-timeout", rdzv_timeout};
  args.insert(args.end(), {"sh", "-c", script});
  return args;
}

// A blocking TCP socket on loopback, closed with the object.
class Socket {
 public:
  explicit Socket(int fd = -1) : fd_(fd) {}
  ~Socket() {
    if (fd_ >= 0) ::close(fd_);
  }
  Socket(Socket&& o) noexcept : fd_(o.fd_) { o.fd_ = -1; }
  void close() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }
  int fd() const { return fd_; }

  // Connects to 127.0.0.1:port, retrying while nobody listens yet.
  static Socket connect_to(int port, double limit_s = 10) {
    double deadline = now_seconds() + limit_s;
    while (now_seconds() < deadline) {
      int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
      sockaddr_in addr{};
      addr.sin_family = AF_INET;
      addr.sin_port = htons(static_cast<uint16_t>(port));
      addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
      if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0) return Socket(fd);
      ::close(fd);
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return Socket();
  }
  // Listens on 127.0.0.1:port.
  static Socket listen_on(int port) {
    int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    int one = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<uint16_t>(port));
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 || ::listen(fd, 8) != 0) {
      ::close(fd);
      return Socket();
    }
    return Socket(fd);
  }
  // The next connection, within limit_s.
  Socket accept_one(double limit_s = 10) const {
    pollfd p{fd_, POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(limit_s * 1000)) != 1) return Socket();
    return Socket(::accept4(fd_, nullptr, nullptr, SOCK_CLOEXEC));
  }
  bool send_text(const std::string& text) const {
    return ::send(fd_, text.data(), text.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(text.size());
  }
  // One line (without '\n'), within limit_s; "" on EOF or timeout.
  std::string read_line(double limit_s = 10) {
    double deadline = now_seconds() + limit_s;
    for (;;) {
      std::size_t end = buffer_.find('\n');
      if (end != std::string::npos) {
        std::string line = buffer_.substr(0, end);
        buffer_.erase(0, end + 1);
        return line;
      }
      if (!read_some(deadline)) return "";
    }
  }
  // Everything until the peer closes (true) or limit_s passes (false).
  bool read_until_eof(std::string* all, double limit_s) {
    double deadline = now_seconds() + limit_s;
    while (read_some(deadline)) {
    }
    *all += buffer_;
    buffer_.clear();
    return eof_;
  }

 private:
  bool read_some(double deadline) {
    if (eof_) return false;
    double left = deadline - now_seconds();
    pollfd p{fd_, POLLIN, 0};
    if (left <= 0 || ::poll(&p, 1, static_cast<int>(left * 1000) + 1) != 1) return false;
    char chunk[4096];
    ssize_t n = ::recv(fd_, chunk, sizeof(chunk), 0);
    if (n <= 0) {
      eof_ = true;
      return false;
    }
    buffer_.append(chunk, static_cast<std::size_t>(n));
    return true;
  }
  int fd_;
  std::string buffer_;
  bool eof_ = false;
};

// A stranger who knows the protocol but not the secret: a wrong JOIN used to
// be told node 0's flags, a right one used to take node 1's place (and learn
// the ranks' port from START). Now neither hears anything, and the real
// node 1 joins.
TEST(HprunAgentSecurity, StrangerWithoutTheSecretLearnsNothingAndCannotJoin) {
  const int port = pick_free_port();
  RunningProcess node0(agent(0, port, "echo node-zero-ran"), kSecuritySecretEnv);
  Socket wrong = Socket::connect_to(port);
  Socket right = Socket::connect_to(port);
  ASSERT_GE(wrong.fd(), 0);
  ASSERT_GE(right.fd(), 0);
  ASSERT_TRUE(wrong.send_text("JOIN 1 3 3 3\n"));
  ASSERT_TRUE(right.send_text("JOIN 1 2 1 0\nFAILED 0 0 steered\n"));
  std::string heard_wrong, heard_right;
  EXPECT_TRUE(wrong.read_until_eof(&heard_wrong, 10)) << "node 0 kept the stranger's connection";
  EXPECT_TRUE(right.read_until_eof(&heard_right, 10)) << "node 0 kept the stranger's connection";
  EXPECT_EQ(heard_wrong, "");
  EXPECT_EQ(heard_right, "");
  ProcessResult r1 = run_process(agent(1, port, "echo node-one-ran"), kSecuritySecretEnv, 30);
  ProcessResult r0 = node0.wait(30);
  EXPECT_TRUE(r1.exited && r1.exit_code == 0) << describe(r1);
  EXPECT_TRUE(r0.exited && r0.exit_code == 0) << describe(r0);
  EXPECT_THAT(r1.out, HasSubstr("node-one-ran")) << describe(r1);
  EXPECT_THAT(r0.err, HasSubstr("turned away a connection from 127.0.0.1: it not an hprun agent: "
                                "expected HELLO, got 'JOIN'"))
      << describe(r0);
  EXPECT_THAT(r0.err, Not(HasSubstr("steered"))) << describe(r0);
}

// A node given another secret is not let in, and says why on its own side.
TEST(HprunAgentSecurity, NodeWithAnotherSecretIsRefusedOnBothSides) {
  const int port = pick_free_port();
  RunningProcess node0(agent(0, port, "true", "3"), kSecuritySecretEnv);
  ProcessResult r1 = run_process(agent(1, port, "true"),
                                 {"HPRUN_RDZV_SECRET=not-the-job-secret-at-all"}, 30);
  ProcessResult r0 = node0.wait(30);
  EXPECT_TRUE(r1.exited && r1.exit_code == 1) << describe(r1);
  EXPECT_THAT(r1.err, HasSubstr("failed the challenge: it does not hold this job's secret"))
      << describe(r1);
  EXPECT_TRUE(r0.exited && r0.exit_code == 1) << describe(r0);
  EXPECT_THAT(r0.err, HasSubstr("node 1 did not join the job")) << describe(r0);
}

// Each turned-away connection used to stop node 0's loop for 0.2 s while it
// waited for the stranger to hang up; 80 strangers that do not hang up
// stopped it for 16 s, longer than a follower waits for a heartbeat (10 s),
// so the job died. Now the job does not notice them.
TEST(HprunAgentSecurity, FloodOfJunkConnectionsDoesNotSilenceNodeZero) {
  const int port = pick_free_port();
  TempDir dir;
  const std::string go = dir.file("go");
  // The ranks wait for the flood to be over.
  const std::string script =
      "i=0; while [ ! -e " + go + " ] && [ $i -lt 1500 ]; do sleep 0.02; i=$((i+1)); done; "
      "[ -e " + go + " ]";
  RunningProcess node0(agent(0, port, script), kSecuritySecretEnv);
  RunningProcess node1(agent(1, port, script), kSecuritySecretEnv);
  // Both joined once both ranks run: wait for node 1's rank to exist.
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  std::vector<Socket> strangers;
  const std::string huge(1 << 20, 'x');  // one line of 1 MiB, no newline
  for (int i = 0; i < 80; ++i) {
    Socket s = Socket::connect_to(port, 5);
    if (s.fd() < 0) continue;
    if (i % 10 == 0) {
      s.send_text(huge.substr(0, 64 * 1024));
    } else {
      s.send_text(i % 2 ? "JOIN 1 2 1 0\n" : "junk \x1b[2J\n");
    }
    strangers.push_back(std::move(s));  // kept open: the old loop waited on each
  }
  // Long enough for the old loop's 16 s stall to end the job.
  std::this_thread::sleep_for(std::chrono::seconds(2));
  std::string burst;
  for (int i = 0; i < 30; ++i) burst += "junk line " + std::to_string(i) + "\n";
  for (Socket& s : strangers) s.send_text(burst);
  std::this_thread::sleep_for(std::chrono::seconds(1));
  { int fd = ::open(go.c_str(), O_WRONLY | O_CREAT, 0600); ::close(fd); }
  ProcessResult r1 = node1.wait(40);
  ProcessResult r0 = node0.wait(40);
  EXPECT_TRUE(r1.exited && r1.exit_code == 0) << describe(r1);
  EXPECT_TRUE(r0.exited && r0.exit_code == 0) << describe(r0);
  EXPECT_THAT(r1.err, Not(HasSubstr("is gone"))) << describe(r1);
  // Named up to a limit, then only counted; never echoed raw.
  EXPECT_THAT(r0.err, HasSubstr("(further ones are only counted)")) << describe(r0);
  EXPECT_THAT(r0.err, Not(HasSubstr("\x1b"))) << describe(r0);
}

// A connection that trickles bytes but never a line used to be kept as long
// as bytes came (the silence limit restarted with each); now it has a fixed
// time to pass the challenge and join.
TEST(HprunAgentSecurity, TricklingConnectionIsDroppedBeforeJoin) {
  const int port = pick_free_port();
  RunningProcess node0(agent(0, port, "true", "30"), kSecuritySecretEnv);
  Socket s = Socket::connect_to(port);
  ASSERT_GE(s.fd(), 0);
  bool dropped = false;
  std::string heard;
  for (int i = 0; i < 40 && !dropped; ++i) {  // 20 s at most; the limit is 5 s
    s.send_text("x");
    dropped = s.read_until_eof(&heard, 0.5);
  }
  EXPECT_TRUE(dropped) << "node 0 kept a connection that never joined";
  EXPECT_EQ(heard, "");
  ::kill(node0.pid(), SIGTERM);
  ProcessResult r0 = node0.wait(20);
  EXPECT_THAT(r0.err, HasSubstr("did not pass the challenge and join within 5 s")) << describe(r0);
}

// An impostor at node 0's address: the follower used to obey any END (and
// START, SAY) from whoever answered there.
TEST(HprunAgentSecurity, FollowerDoesNotObeyAnImpostorNodeZero) {
  const int port = pick_free_port();
  Socket server = Socket::listen_on(port);
  ASSERT_GE(server.fd(), 0);
  RunningProcess node1(agent(1, port, "echo ranks-started"), kSecuritySecretEnv);
  Socket conn = server.accept_one();
  ASSERT_GE(conn.fd(), 0);
  conn.read_line();  // HELLO (or, before the fix, JOIN)
  conn.send_text("END 0\nSTART 0 29500\n");
  ProcessResult r1 = node1.wait(30);
  EXPECT_TRUE(r1.exited && r1.exit_code == 1) << describe(r1);
  EXPECT_THAT(r1.err, HasSubstr("not joining node 0 (127.0.0.1:" + std::to_string(port) +
                                "): it is not an hprun agent of this version: expected CHALLENGE, "
                                "got 'END'"))
      << describe(r1);
  EXPECT_THAT(r1.out, Not(HasSubstr("ranks-started"))) << describe(r1);
}

// Even a node 0 holding the secret is held to the protocol: an exit code
// past 255 (exit(256) is exit 0) is refused, and its text reaches the
// terminal with control characters escaped.
TEST(HprunAgentSecurity, ExitCodesAndTextFromNodeZeroAreChecked) {
  const int port = pick_free_port();
  Socket server = Socket::listen_on(port);
  ASSERT_GE(server.fd(), 0);
  RunningProcess node1(agent(1, port, "true"), kSecuritySecretEnv);
  Socket conn = server.accept_one();
  ASSERT_GE(conn.fd(), 0);
  std::string hello = conn.read_line();
  std::string node_nonce = hello.size() > 8 ? hello.substr(8) : "";
  const std::string node0_nonce(64, 'a');
  conn.send_text("CHALLENGE " + node0_nonce + " " + node0_mac(kSecuritySecret, node_nonce, node0_nonce) +
                 "\n");
  conn.read_line();  // AUTH
  conn.read_line();  // JOIN
  conn.send_text("SAY \x1b]0;owned\x07\x1b[2Jcleared\nEND 256\n");
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  conn.close();  // node 0 is gone
  ProcessResult r1 = node1.wait(30);
  EXPECT_TRUE(r1.exited && r1.exit_code == 1) << describe(r1);
  EXPECT_THAT(r1.err, HasSubstr("hprun: \\x1b]0;owned\\x07\\x1b[2Jcleared\n")) << describe(r1);
  EXPECT_THAT(r1.err, Not(HasSubstr("\x1b"))) << describe(r1);
  EXPECT_THAT(r1.err, HasSubstr("sent a malformed END (expected END <exit code 0..255>)"))
      << describe(r1);
}

// A multi-node job without a secret does not start: there would be nothing
// to tell a stranger from a node.
TEST(HprunAgentSecurity, MultiNodeJobNeedsASecret) {
  const int port = pick_free_port();
  Args args = agent(0, port, "true");
  args.insert(args.begin(), {"/usr/bin/env", "-u", "HPRUN_RDZV_SECRET"});
  ProcessResult r = run_process(args, {}, 30);
  EXPECT_TRUE(r.exited && r.exit_code == 2) << describe(r);
  EXPECT_THAT(r.err, HasSubstr("needs a secret shared by its nodes")) << describe(r);
}

}  // namespace
}  // namespace hp::launcher::testing
