// The agents' line protocol (agents.h), apart from the sockets: framing with
// a line limit, the mutual challenge-response that comes before JOIN, and
// strict parsers for every message. Pure and deterministic (the nonces come
// from the caller), so that tests can drive it with any input; nothing here
// blocks, throws on peer input or trusts it: every line is either parsed
// into ranges checked here or refused with a reason that names what was
// wrong (never the job's own flags).
//
// The challenge, on every connection before JOIN (docs: README, "Several
// nodes"). S is the job's secret, n the node's and z node 0's fresh 32-byte
// nonce, both sent as 64 hex digits:
//   node   -> node 0  HELLO 1 <n>
//   node 0 -> node    CHALLENGE <z> <HMAC-SHA256(S, "hprun node0 <n> <z>")>
//   node   -> node 0  AUTH <HMAC-SHA256(S, "hprun node <z> <n>")>
//   node   -> node 0  JOIN ...            (parsed only after AUTH checked)
// Each side proves it holds S over the other's fresh nonce, so a recorded
// exchange cannot be replayed, and the two MACs are over differently
// labelled messages, so one side's MAC is never an answer for the other.
// The connection is not encrypted or protected after that: see the README.
//
// Not thread-safe; each object belongs to one connection.
#pragma once

#include <cstddef>
#include <deque>
#include <optional>
#include <string>

namespace hp::launcher {

// Limits on what a peer may make node 0 hold (docs: README, "Several nodes").
constexpr std::size_t kMaxLineBytes = 4096;       // one protocol line, without '\n'
constexpr std::size_t kMaxPendingAgents = 32;      // connections not yet joined
constexpr double kHandshakeLimitS = 5;             // accept -> JOIN, at most
constexpr std::size_t kNonceBytes = 32;
constexpr std::size_t kMinSecretBytes = 16;
constexpr std::size_t kMaxSecretBytes = 4096;
constexpr const char* kSecretEnv = "HPRUN_RDZV_SECRET";

// Splits a byte stream into lines without rescanning what it has seen.
// Once a line grows past `max_line` bytes the buffer refuses everything
// (error() says why) and holds nothing more.
class LineBuffer {
 public:
  explicit LineBuffer(std::size_t max_line = kMaxLineBytes) : max_line_(max_line) {}
  // False once the stream broke the limit.
  bool append(const char* data, std::size_t size);
  bool next_line(std::string* line);
  const std::string& error() const { return error_; }

 private:
  std::size_t max_line_;
  std::string partial_;
  std::deque<std::string> lines_;
  std::string error_;
};

// Peer text made safe for a terminal: printable ASCII stays, a backslash
// becomes "\\", any other byte "\xNN"; cut to `max_bytes` of input with
// "..." after.
std::string printable(const std::string& text, std::size_t max_bytes = 300);

// --- messages ---

struct Join {
  int node = 0, nnodes = 0, nproc = 0, max_restarts = 0;
};
// node -> node 0, after JOIN.
struct NodeMessage {
  enum class Kind { kHeartbeat, kReady, kDone, kFailed } kind = Kind::kHeartbeat;
  int code = 0;              // kFailed: the exit code, 0..255
  bool restartable = false;  // kFailed
  std::string what;          // kFailed: the node's own words (print with printable())
};
// node 0 -> node, after the challenge.
struct Node0Message {
  enum class Kind { kHeartbeat, kStart, kSay, kStop, kEnd } kind = Kind::kHeartbeat;
  int restart_count = 0;  // kStart
  int port = 0;           // kStart: 1..65535
  int code = 0;           // kEnd: 0..255
  std::string text;       // kSay (print with printable())
};

// Exactly one of `value` and `refusal` is set.
template <class T>
struct Parsed {
  std::optional<T> value;
  std::string refusal;
};

Parsed<Join> parse_join(const std::string& line);
Parsed<NodeMessage> parse_node_message(const std::string& line);
Parsed<Node0Message> parse_node0_message(const std::string& line);

// A decimal in [min, max], digits only ("007" included, "+7", " 7", "0x7"
// not). The parsers' only way to read a number.
bool parse_bounded_int(const std::string& text, long min, long max, int* value);

// --- the challenge ---

struct GateStep {
  enum class Status { kWaiting, kPassed, kRefused } status = Status::kWaiting;
  std::string reply;  // lines to send now ('\n'-separated, no final '\n'), or empty
  Join join;          // node 0's gate, kPassed: the JOIN that followed AUTH
  std::string refusal;  // kRefused: why, naming what was wrong
};

// Node 0's side of one connection until JOIN. `nonce` is kNonceBytes fresh
// random bytes.
class Node0Gate {
 public:
  Node0Gate(std::string secret, std::string nonce);
  // The next line from the peer. After kPassed or kRefused, every line is
  // refused.
  GateStep on_line(const std::string& line);

 private:
  enum class State { kHello, kAuth, kJoin, kOver };
  GateStep refuse(const std::string& why);
  std::string secret_, nonce_hex_, peer_nonce_hex_;
  State state_ = State::kHello;
};

// A node's side: hello() is its first line; on_line takes node 0's answer
// and, once node 0 proved it holds the secret, passes with the AUTH line to
// send (JOIN follows it).
class FollowerGate {
 public:
  FollowerGate(std::string secret, std::string nonce);
  std::string hello() const;
  GateStep on_line(const std::string& line);

 private:
  std::string secret_, nonce_hex_;
  bool over_ = false;
};

// The MACs of the challenge, hex (exposed for tests that play one side).
std::string node0_mac(const std::string& secret, const std::string& node_nonce_hex,
                      const std::string& node0_nonce_hex);
std::string node_mac(const std::string& secret, const std::string& node0_nonce_hex,
                     const std::string& node_nonce_hex);

// --- the secret ---

// The job's secret, from --rdzv-secret-file `file` (when not empty) or else
// the environment's HPRUN_RDZV_SECRET (`env_value`, may be null). The file
// must be a regular file owned by this user that nobody else may read or
// write (chmod 600), holding kMinSecretBytes..kMaxSecretBytes bytes (one
// final newline is dropped). Throws std::invalid_argument naming the file or
// variable and what was expected; when neither is given, says how to pass one.
std::string load_rdzv_secret(const std::string& file, const char* env_value);

}  // namespace hp::launcher
