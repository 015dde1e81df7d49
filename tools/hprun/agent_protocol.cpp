#include "tools/hprun/agent_protocol.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "tools/hprun/sha256.h"

namespace hp::launcher {
namespace {

// "FAILED 3 1 rank 2 exited" -> {"FAILED", "3", "1", "rank 2 exited"} for
// words = 3: the first `words` words separated by one space each, then the
// rest of the line (which may be empty) as one more field. Nullopt when the
// line has fewer words, or a word is empty (two spaces in a row).
std::optional<std::vector<std::string>> fields(const std::string& line, std::size_t words,
                                               bool rest_allowed) {
  std::vector<std::string> result;
  std::size_t pos = 0;
  while (result.size() < words) {
    std::size_t space = line.find(' ', pos);
    std::string word = line.substr(pos, space == std::string::npos ? std::string::npos : space - pos);
    if (word.empty()) return std::nullopt;
    result.push_back(word);
    if (space == std::string::npos) {
      pos = std::string::npos;
      break;
    }
    pos = space + 1;
  }
  if (result.size() < words) return std::nullopt;
  std::string rest = pos == std::string::npos ? "" : line.substr(pos);
  if (!rest_allowed && pos != std::string::npos) return std::nullopt;
  result.push_back(rest);
  return result;
}

// The first word of a peer's line, safe to name in a refusal.
std::string command_of(const std::string& line) {
  std::string word = line.substr(0, line.find(' '));
  if (word.empty()) return "an empty line";
  return "'" + printable(word, 16) + "'";
}

bool is_hex(const std::string& text, std::size_t size) {
  if (text.size() != size) return false;
  for (char c : text) {
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  }
  return true;
}

constexpr long kMaxNodes = 1 << 16;      // as --nnodes and -n (options.cpp)
constexpr long kMaxRestarts = 1 << 20;   // as --max-restarts

template <class T>
Parsed<T> refused(const std::string& why) {
  Parsed<T> p;
  p.refusal = why;
  return p;
}

}  // namespace

bool LineBuffer::append(const char* data, std::size_t size) {
  if (!error_.empty()) return false;
  const char* end = data + size;
  while (data < end) {
    const char* newline = static_cast<const char*>(std::memchr(data, '\n', end - data));
    const char* stop = newline ? newline : end;
    if (partial_.size() + static_cast<std::size_t>(stop - data) > max_line_) {
      error_ = "sent a line longer than " + std::to_string(max_line_) + " bytes";
      partial_.clear();
      partial_.shrink_to_fit();
      return false;
    }
    partial_.append(data, stop);
    if (!newline) break;
    lines_.push_back(std::move(partial_));
    partial_.clear();
    data = newline + 1;
  }
  return true;
}

bool LineBuffer::next_line(std::string* line) {
  if (lines_.empty()) return false;
  *line = std::move(lines_.front());
  lines_.pop_front();
  return true;
}

std::string printable(const std::string& text, std::size_t max_bytes) {
  static const char kDigits[] = "0123456789abcdef";
  std::string out;
  const std::size_t n = std::min(text.size(), max_bytes);
  for (std::size_t i = 0; i < n; ++i) {
    const auto c = static_cast<unsigned char>(text[i]);
    if (c == '\\') {
      out += "\\\\";
    } else if (c >= 0x20 && c < 0x7f) {
      out += static_cast<char>(c);
    } else {
      out += "\\x";
      out += kDigits[c >> 4];
      out += kDigits[c & 15];
    }
  }
  if (text.size() > max_bytes) out += "...";
  return out;
}

bool parse_bounded_int(const std::string& text, long min, long max, int* value) {
  // Nine digits fit an int; more are out of every range used here.
  if (text.empty() || text.size() > 9) return false;
  long parsed = 0;
  for (char c : text) {
    if (c < '0' || c > '9') return false;
    parsed = parsed * 10 + (c - '0');
  }
  if (parsed < min || parsed > max) return false;
  *value = static_cast<int>(parsed);
  return true;
}

Parsed<Join> parse_join(const std::string& line) {
  auto f = fields(line, 5, false);
  if (!f || (*f)[0] != "JOIN") return refused<Join>("expected JOIN, got " + command_of(line));
  Join j;
  if (!parse_bounded_int((*f)[1], 0, kMaxNodes, &j.node) ||
      !parse_bounded_int((*f)[2], 1, kMaxNodes, &j.nnodes) ||
      !parse_bounded_int((*f)[3], 1, kMaxNodes, &j.nproc) ||
      !parse_bounded_int((*f)[4], 0, kMaxRestarts, &j.max_restarts)) {
    return refused<Join>("a malformed JOIN (expected JOIN <node> <nnodes> <nproc> <restarts>)");
  }
  Parsed<Join> p;
  p.value = j;
  return p;
}

Parsed<NodeMessage> parse_node_message(const std::string& line) {
  using Kind = NodeMessage::Kind;
  NodeMessage m;
  if (line == "HB") {
    m.kind = Kind::kHeartbeat;
  } else if (line == "READY") {
    m.kind = Kind::kReady;
  } else if (line == "DONE") {
    m.kind = Kind::kDone;
  } else if (line.rfind("FAILED ", 0) == 0) {
    auto f = fields(line, 3, true);
    int restartable = 0;
    if (!f || !parse_bounded_int((*f)[1], 0, 255, &m.code) ||
        !parse_bounded_int((*f)[2], 0, 1, &restartable)) {
      return refused<NodeMessage>(
          "a malformed FAILED (expected FAILED <exit code 0..255> <0|1> <what>)");
    }
    m.kind = Kind::kFailed;
    m.restartable = restartable == 1;
    m.what = (*f)[3];
  } else {
    return refused<NodeMessage>("an unknown message " + command_of(line));
  }
  Parsed<NodeMessage> p;
  p.value = m;
  return p;
}

Parsed<Node0Message> parse_node0_message(const std::string& line) {
  using Kind = Node0Message::Kind;
  Node0Message m;
  if (line == "HB") {
    m.kind = Kind::kHeartbeat;
  } else if (line == "STOP") {
    m.kind = Kind::kStop;
  } else if (line.rfind("SAY ", 0) == 0) {
    m.kind = Kind::kSay;
    m.text = line.substr(4);
  } else if (line.rfind("START ", 0) == 0) {
    auto f = fields(line, 3, false);
    if (!f || !parse_bounded_int((*f)[1], 0, kMaxRestarts, &m.restart_count) ||
        !parse_bounded_int((*f)[2], 1, 65535, &m.port)) {
      return refused<Node0Message>(
          "a malformed START (expected START <restart 0..1048576> <port 1..65535>)");
    }
    m.kind = Kind::kStart;
  } else if (line.rfind("END ", 0) == 0) {
    auto f = fields(line, 2, false);
    if (!f || !parse_bounded_int((*f)[1], 0, 255, &m.code)) {
      return refused<Node0Message>("a malformed END (expected END <exit code 0..255>)");
    }
    m.kind = Kind::kEnd;
  } else {
    return refused<Node0Message>("an unknown message " + command_of(line));
  }
  Parsed<Node0Message> p;
  p.value = m;
  return p;
}

std::string node0_mac(const std::string& secret, const std::string& node_nonce_hex,
                      const std::string& node0_nonce_hex) {
  return to_hex(hmac_sha256(secret, "hprun node0 " + node_nonce_hex + " " + node0_nonce_hex));
}

std::string node_mac(const std::string& secret, const std::string& node0_nonce_hex,
                     const std::string& node_nonce_hex) {
  return to_hex(hmac_sha256(secret, "hprun node " + node0_nonce_hex + " " + node_nonce_hex));
}

Node0Gate::Node0Gate(std::string secret, std::string nonce)
    : secret_(std::move(secret)),
      nonce_hex_(to_hex(reinterpret_cast<const uint8_t*>(nonce.data()), nonce.size())) {}

GateStep Node0Gate::refuse(const std::string& why) {
  state_ = State::kOver;
  GateStep step;
  step.status = GateStep::Status::kRefused;
  step.refusal = why;
  return step;
}

GateStep Node0Gate::on_line(const std::string& line) {
  const std::size_t hex = 2 * kNonceBytes;
  switch (state_) {
    case State::kHello: {
      auto f = fields(line, 3, false);
      if (!f || (*f)[0] != "HELLO") {
        return refuse("not an hprun agent: expected HELLO, got " + command_of(line));
      }
      if ((*f)[1] != "1") return refuse("an unknown protocol version in HELLO");
      if (!is_hex((*f)[2], hex)) return refuse("a malformed nonce in HELLO");
      if ((*f)[2] == nonce_hex_) return refuse("node 0's own nonce in HELLO");
      peer_nonce_hex_ = (*f)[2];
      state_ = State::kAuth;
      GateStep step;
      step.reply =
          "CHALLENGE " + nonce_hex_ + " " + node0_mac(secret_, peer_nonce_hex_, nonce_hex_);
      return step;
    }
    case State::kAuth: {
      auto f = fields(line, 2, false);
      if (!f || (*f)[0] != "AUTH") return refuse("expected AUTH, got " + command_of(line));
      if (!is_hex((*f)[1], hex) ||
          !constant_time_equal((*f)[1], node_mac(secret_, nonce_hex_, peer_nonce_hex_))) {
        return refuse("failed the challenge (not the job's secret)");
      }
      state_ = State::kJoin;
      return {};
    }
    case State::kJoin: {
      Parsed<Join> join = parse_join(line);
      if (!join.value) return refuse(join.refusal);
      state_ = State::kOver;
      GateStep step;
      step.status = GateStep::Status::kPassed;
      step.join = *join.value;
      return step;
    }
    case State::kOver:
      break;
  }
  return refuse("a line after the connection was decided");
}

FollowerGate::FollowerGate(std::string secret, std::string nonce)
    : secret_(std::move(secret)),
      nonce_hex_(to_hex(reinterpret_cast<const uint8_t*>(nonce.data()), nonce.size())) {}

std::string FollowerGate::hello() const { return "HELLO 1 " + nonce_hex_; }

GateStep FollowerGate::on_line(const std::string& line) {
  GateStep step;
  step.status = GateStep::Status::kRefused;
  if (over_) {
    step.refusal = "a line after the connection was decided";
    return step;
  }
  over_ = true;
  auto f = fields(line, 3, false);
  if (!f || (*f)[0] != "CHALLENGE") {
    step.refusal = "it is not an hprun agent of this version: expected CHALLENGE, got " +
                   command_of(line);
    return step;
  }
  const std::size_t hex = 2 * kNonceBytes;
  const std::string& node0_nonce = (*f)[1];
  if (!is_hex(node0_nonce, hex) || node0_nonce == nonce_hex_ || !is_hex((*f)[2], hex) ||
      !constant_time_equal((*f)[2], node0_mac(secret_, nonce_hex_, node0_nonce))) {
    step.refusal =
        "it failed the challenge: it does not hold this job's secret (is it another job, or "
        "was it given another --rdzv-secret-file or HPRUN_RDZV_SECRET?)";
    return step;
  }
  step.status = GateStep::Status::kPassed;
  step.reply = "AUTH " + node_mac(secret_, node0_nonce, nonce_hex_);
  return step;
}

std::string load_rdzv_secret(const std::string& file, const char* env_value) {
  const std::string sizes = std::to_string(kMinSecretBytes) + ".." +
                            std::to_string(kMaxSecretBytes) + " bytes";
  if (file.empty()) {
    if (env_value == nullptr) {
      throw std::invalid_argument(
          "a job with --nnodes > 1 needs a secret shared by its nodes: give every node the "
          "same --rdzv-secret-file PATH (mode 0600) or " + std::string(kSecretEnv) +
          " (e.g. from 'head -c 32 /dev/urandom | base64')");
    }
    std::string secret = env_value;
    if (secret.size() < kMinSecretBytes || secret.size() > kMaxSecretBytes) {
      throw std::invalid_argument(std::string(kSecretEnv) + " must hold " + sizes + ", got " +
                                  std::to_string(secret.size()));
    }
    return secret;
  }
  const std::string named = "--rdzv-secret-file '" + printable(file) + "'";
  // O_NOFOLLOW and fstat on the open file: what is checked is what is read.
  int fd = ::open(file.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
  if (fd < 0) {
    throw std::invalid_argument(named + ": cannot open it: " + std::strerror(errno));
  }
  struct stat st {};
  std::string problem;
  if (::fstat(fd, &st) != 0) {
    problem = std::string("cannot stat it: ") + std::strerror(errno);
  } else if (!S_ISREG(st.st_mode)) {
    problem = "must be a regular file";
  } else if (st.st_uid != ::geteuid()) {
    problem = "must be owned by the user running hprun (uid " + std::to_string(::geteuid()) +
              "), it is owned by uid " + std::to_string(st.st_uid);
  } else if ((st.st_mode & 077) != 0) {
    char mode[8];
    std::snprintf(mode, sizeof(mode), "%03o", static_cast<unsigned>(st.st_mode & 0777));
    problem = std::string("must be readable by its owner only (chmod 600), its mode is ") + mode;
  } else if (st.st_size > static_cast<off_t>(kMaxSecretBytes + 1)) {
    problem = "must hold " + sizes + ", it has " + std::to_string(st.st_size);
  }
  std::string secret;
  if (problem.empty()) {
    char buffer[kMaxSecretBytes + 2];
    ssize_t n = 0;
    std::size_t got = 0;
    while ((n = ::read(fd, buffer + got, sizeof(buffer) - got)) > 0) {
      got += static_cast<std::size_t>(n);
      if (got == sizeof(buffer)) break;
    }
    if (n < 0) problem = std::string("cannot read it: ") + std::strerror(errno);
    secret.assign(buffer, got);
    if (!secret.empty() && secret.back() == '\n') secret.pop_back();
    if (problem.empty() && (secret.size() < kMinSecretBytes || secret.size() > kMaxSecretBytes)) {
      problem = "must hold " + sizes + " (a final newline not counted), it has " +
                std::to_string(secret.size());
    }
  }
  ::close(fd);
  if (!problem.empty()) throw std::invalid_argument(named + ": " + problem);
  return secret;
}

}  // namespace hp::launcher
