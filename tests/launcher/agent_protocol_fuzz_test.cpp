// A seeded mutation loop over the agents' line protocol
// (tools/hprun/agent_protocol.h): lines crafted as a stranger would (the
// corpus below) are mutated byte-wise and token-wise and fed to every
// parser, both sides of the challenge and the line framing. Properties:
// nothing crashes (hp_launcher is built with _GLIBCXX_ASSERTIONS, so an
// index out of range aborts); every line is either parsed into checked
// ranges or refused with a named, printable reason; no gate passes without
// the right MAC. The code under test does no I/O, so it cannot block; the
// loop is bounded by its iteration count (fixed seed: a failure replays).

#include <algorithm>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "tools/hprun/agent_protocol.h"
#include "tools/hprun/sha256.h"

namespace hp::launcher::testing {
namespace {

constexpr uint32_t kSeed = 0x4850'0038;
constexpr int kIterations = 500000;

const std::string kFuzzSecret = "fuzz-secret-0123456789";

std::string hex_of(const std::string& raw) {
  return to_hex(reinterpret_cast<const uint8_t*>(raw.data()), raw.size());
}

bool all_printable(const std::string& text) {
  return std::all_of(text.begin(), text.end(), [](char c) { return c >= 0x20 && c < 0x7f; });
}

class Mutator {
 public:
  explicit Mutator(uint32_t seed) : rng_(seed) {}
  std::size_t below(std::size_t n) { return n == 0 ? 0 : rng_() % n; }

  std::string mutate(std::string line, const std::vector<std::string>& corpus) {
    static const char* kNumbers[] = {"-1", "0",     "1",         "255",        "256",
                                     "65535", "65536", "999999999", "9999999999", "007",
                                     "+1",  "0x10",  "1e3",       "",           " "};
    static const char kSpecial[] = {'\n', '\0', ' ', '\r', '\x1b', '\x7f', '\xff', '\\'};
    const int rounds = 1 + static_cast<int>(below(4));
    for (int r = 0; r < rounds; ++r) {
      switch (below(9)) {
        case 0:  // flip a bit
          if (!line.empty()) line[below(line.size())] ^= static_cast<char>(1 << below(8));
          break;
        case 1:  // insert a random byte
          line.insert(line.begin() + static_cast<long>(below(line.size() + 1)),
                      static_cast<char>(below(256)));
          break;
        case 2:  // delete a run
          if (!line.empty()) {
            std::size_t at = below(line.size());
            line.erase(at, 1 + below(std::min<std::size_t>(8, line.size() - at)));
          }
          break;
        case 3: {  // replace a word with a boundary number
          std::vector<std::size_t> starts = {0};
          for (std::size_t i = 0; i < line.size(); ++i) {
            if (line[i] == ' ') starts.push_back(i + 1);
          }
          std::size_t start = starts[below(starts.size())];
          std::size_t end = std::min(line.find(' ', start), line.size());
          line.replace(start, end - start, kNumbers[below(std::size(kNumbers))]);
          break;
        }
        case 4: {  // splice with another corpus line
          const std::string& other = corpus[below(corpus.size())];
          line = line.substr(0, below(line.size() + 1)) + other.substr(below(other.size() + 1));
          break;
        }
        case 5:  // a special byte
          line.insert(line.begin() + static_cast<long>(below(line.size() + 1)),
                      kSpecial[below(sizeof(kSpecial))]);
          break;
        case 6:  // truncate
          line.resize(below(line.size() + 1));
          break;
        case 7:  // duplicate a chunk (growing lines)
          if (!line.empty()) line += line.substr(below(line.size()));
          break;
        default:  // leave it (a valid line must still parse)
          break;
      }
    }
    return line;
  }

 private:
  std::mt19937 rng_;
};

void check_node_message(const std::string& line) {
  Parsed<NodeMessage> p = parse_node_message(line);
  ASSERT_NE(p.value.has_value(), !p.refusal.empty()) << printable(line);
  if (!p.value) {
    ASSERT_TRUE(all_printable(p.refusal)) << p.refusal;
    return;
  }
  ASSERT_GE(p.value->code, 0);
  ASSERT_LE(p.value->code, 255);
  ASSERT_TRUE(all_printable(printable(p.value->what)));
}

void check_node0_message(const std::string& line) {
  Parsed<Node0Message> p = parse_node0_message(line);
  ASSERT_NE(p.value.has_value(), !p.refusal.empty()) << printable(line);
  if (!p.value) {
    ASSERT_TRUE(all_printable(p.refusal)) << p.refusal;
    return;
  }
  const Node0Message& m = *p.value;
  ASSERT_GE(m.code, 0);
  ASSERT_LE(m.code, 255);
  if (m.kind == Node0Message::Kind::kStart) {
    ASSERT_GE(m.port, 1);
    ASSERT_LE(m.port, 65535);
    ASSERT_GE(m.restart_count, 0);
  }
  ASSERT_TRUE(all_printable(printable(m.text)));
}

void check_join(const std::string& line) {
  Parsed<Join> p = parse_join(line);
  ASSERT_NE(p.value.has_value(), !p.refusal.empty()) << printable(line);
  if (!p.value) {
    ASSERT_TRUE(all_printable(p.refusal)) << p.refusal;
    return;
  }
  ASSERT_GE(p.value->node, 0);
  ASSERT_GE(p.value->nnodes, 1);
  ASSERT_GE(p.value->nproc, 1);
  ASSERT_GE(p.value->max_restarts, 0);
}

TEST(AgentProtocolFuzz, SeededMutationsAreParsedInRangeOrRefusedByName) {
  Mutator m(kSeed);
  const std::string node_nonce(kNonceBytes, 'n'), node0_nonce(kNonceBytes, 'z');
  const std::string hello = "HELLO 1 " + hex_of(node_nonce);
  const std::string auth = "AUTH " + node_mac(kFuzzSecret, hex_of(node0_nonce), hex_of(node_nonce));
  const std::string challenge = "CHALLENGE " + hex_of(node0_nonce) + " " +
                                node0_mac(kFuzzSecret, hex_of(node_nonce), hex_of(node0_nonce));
  // What a stranger would try (docs: README, "Several nodes").
  const std::vector<std::string> corpus = {
      "JOIN 1 2 2 0", "JOIN 1 3 3 3", "JOIN 0 2 2 0", "JOIN 9 2 2 0", "READY", "DONE", "HB",
      "FAILED c 0", "FAILED 3 1 rank 2 (pid 7) exited with status 3", "FAILED 256 0 x",
      "START 0 29500", "START 1 0", "SAY \x1b[2J\x1b]0;owned\x07", "SAY hello", "STOP",
      "END 256", "END 0", "END -1", hello, auth, challenge, "HELLO 2 " + hex_of(node_nonce),
      "AUTH " + std::string(64, '0'), "", " ", std::string(5000, 'A'), "JOIN\t1 2 2 0",
      "END 1\r", std::string("HB\0", 3)};

  int refused = 0, parsed = 0, passed = 0;
  for (int i = 0; i < kIterations; ++i) {
    const std::string& seed_line = corpus[m.below(corpus.size())];
    const std::string line = m.mutate(seed_line, corpus);
    ASSERT_NO_FATAL_FAILURE(check_node_message(line));
    ASSERT_NO_FATAL_FAILURE(check_node0_message(line));
    ASSERT_NO_FATAL_FAILURE(check_join(line));
    (parse_node_message(line).value ? parsed : refused)++;
    ASSERT_TRUE(all_printable(printable(line)));

    // Node 0's gate: a valid prefix of the challenge of random length, then
    // mutated lines. It may only pass after the exact AUTH line.
    {
      Node0Gate gate(kFuzzSecret, node0_nonce);
      const std::size_t valid = m.below(3);  // 0: none, 1: HELLO, 2: HELLO + AUTH
      bool saw_auth = false, over = false;
      std::vector<std::string> lines;
      if (valid >= 1) lines.push_back(hello);
      if (valid >= 2) lines.push_back(auth);
      for (std::size_t k = 0, n = 1 + m.below(3); k < n; ++k) {
        lines.push_back(m.mutate(corpus[m.below(corpus.size())], corpus));
      }
      for (std::size_t k = 0; k < lines.size(); ++k) {
        GateStep step = gate.on_line(lines[k]);
        if (lines[k] == auth && k == 1 && lines[0] == hello) saw_auth = true;
        if (over) {
          ASSERT_EQ(step.status, GateStep::Status::kRefused);
          continue;
        }
        if (step.status == GateStep::Status::kRefused) {
          ASSERT_FALSE(step.refusal.empty());
          ASSERT_TRUE(all_printable(step.refusal)) << step.refusal;
          ASSERT_TRUE(step.reply.empty());
          over = true;
        } else if (step.status == GateStep::Status::kPassed) {
          ASSERT_TRUE(saw_auth) << "passed without the right AUTH: " << printable(lines[k]);
          ASSERT_TRUE(parse_join(lines[k]).value);
          ++passed;
          over = true;
        }
      }
    }
    // The follower's gate passes only on node 0's exact challenge.
    {
      FollowerGate gate(kFuzzSecret, node_nonce);
      std::string answer = m.below(4) == 0 ? challenge : m.mutate(challenge, corpus);
      GateStep step = gate.on_line(answer);
      if (step.status == GateStep::Status::kPassed) {
        ASSERT_EQ(answer, challenge);
        ASSERT_EQ(step.reply, auth);
      } else {
        ASSERT_EQ(step.status, GateStep::Status::kRefused);
        ASSERT_FALSE(step.refusal.empty());
        ASSERT_TRUE(all_printable(step.refusal)) << step.refusal;
      }
    }
    // Framing: random chunks of mutated bytes never yield a line over the
    // limit, and the first overlong line ends the stream.
    if (i % 8 == 0) {
      const std::size_t limit = 1 + m.below(64);
      LineBuffer buffer(limit);
      std::string stream;
      for (std::size_t k = 0, n = 1 + m.below(6); k < n; ++k) stream += line + "\n";
      bool ok = true;
      for (std::size_t at = 0; at < stream.size();) {
        std::size_t chunk = 1 + m.below(stream.size() - at);
        bool accepted = buffer.append(stream.data() + at, chunk);
        if (!ok) {
          ASSERT_FALSE(accepted);
        }
        if (!accepted) {
          ASSERT_EQ(buffer.error(), "sent a line longer than " + std::to_string(limit) + " bytes");
        }
        ok = ok && accepted;
        at += chunk;
        for (std::string out; buffer.next_line(&out);) {
          ASSERT_LE(out.size(), limit);
          ASSERT_EQ(out.find('\n'), std::string::npos);
        }
      }
    }
  }
  // The mutations reach both outcomes, and valid challenges did pass.
  EXPECT_GT(parsed, 0);
  EXPECT_GT(refused, 0);
  EXPECT_GT(passed, 0);
  RecordProperty("iterations", kIterations);
}

}  // namespace
}  // namespace hp::launcher::testing
