// The agents' protocol apart from sockets (tools/hprun/agent_protocol.h):
// SHA-256 and HMAC-SHA256 against the published vectors, the strict
// parsers, the challenge in both directions, the secret's sources, and a
// seeded mutation loop over all of it.

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "tests/launcher/process_runner.h"
#include "tools/hprun/agent_protocol.h"
#include "tools/hprun/sha256.h"

namespace hp::launcher::testing {
namespace {

std::string bytes(std::size_t n, int value) { return std::string(n, static_cast<char>(value)); }

TEST(Sha256, Fips180Examples) {
  EXPECT_EQ(to_hex(sha256("abc")),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  EXPECT_EQ(to_hex(sha256("")),
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(to_hex(sha256("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq")),
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  EXPECT_EQ(to_hex(sha256(std::string(1000000, 'a'))),
            "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
}

// Around the padding's block boundaries (one or two final blocks); the
// digests are Python's hashlib's.
TEST(Sha256, PaddingBoundaries) {
  const std::pair<std::size_t, const char*> cases[] = {
      {55, "9f4390f8d30c2dd92ec9f095b65e2b9ae9b0a925a5258e241c9f1e910f734318"},
      {56, "b35439a4ac6f0948b6d6f9e3c6af0f5f590ce20f1bde7090ef7970686ec6738a"},
      {63, "7d3e74a05d7db15bce4ad9ec0658ea98e3f06eeecf16b4c6fff2da457ddc2f34"},
      {64, "ffe054fe7ae0cb6dc65c3af9b61d5209f439851db43d0ba5997337df154668eb"},
      {119, "31eba51c313a5c08226adf18d4a359cfdfd8d2e816b13f4af952f7ea6584dcfb"},
      {120, "2f3d335432c70b580af0e8e1b3674a7c020d683aa5f73aaaedfdc55af904c21c"},
  };
  for (const auto& [n, digest] : cases) EXPECT_EQ(to_hex(sha256(std::string(n, 'a'))), digest) << n;
}

TEST(HmacSha256, Rfc4231Vectors) {
  std::string key4;
  for (int i = 1; i <= 25; ++i) key4 += static_cast<char>(i);
  struct Case {
    std::string key, data, mac;
  };
  const Case cases[] = {
      {bytes(20, 0x0b), "Hi There",
       "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7"},
      {"Jefe", "what do ya want for nothing?",
       "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"},
      {bytes(20, 0xaa), bytes(50, 0xdd),
       "773ea91e36800e46854db8ebd09181a72959098b3ef8c122d9635514ced565fe"},
      {key4, bytes(50, 0xcd), "82558a389a443c0ea4cc819899f2083a85f0faa3e578f8077a2e3ff46729665b"},
      {bytes(131, 0xaa), "Test Using Larger Than Block-Size Key - Hash Key First",
       "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54"},
      {bytes(131, 0xaa),
       "This is a test using a larger than block-size key and a larger than block-size data. "
       "The key needs to be hashed before being used by the HMAC algorithm.",
       "9b09ffa71b942fcb27635fbcd5b0e944bfdc63644f0713938a7f51535c3a35e2"},
  };
  for (const Case& c : cases) EXPECT_EQ(to_hex(hmac_sha256(c.key, c.data)), c.mac) << c.data;
  // Test case 5 is truncated to 128 bits.
  EXPECT_EQ(to_hex(hmac_sha256(bytes(20, 0x0c), "Test With Truncation")).substr(0, 32),
            "a3b6167473100ee06e0c796c2955552b");
}

TEST(ConstantTimeEqual, ComparesContentsAndLength) {
  EXPECT_TRUE(constant_time_equal("abc", "abc"));
  EXPECT_FALSE(constant_time_equal("abc", "abd"));
  EXPECT_FALSE(constant_time_equal("xbc", "abc"));
  EXPECT_FALSE(constant_time_equal("abc", "abcd"));
  EXPECT_TRUE(constant_time_equal("", ""));
}

TEST(RandomBytes, AreFreshEachTime) {
  std::string a = random_bytes(kNonceBytes), b = random_bytes(kNonceBytes);
  EXPECT_EQ(a.size(), kNonceBytes);
  EXPECT_NE(a, b);
}

// --- parsers ---

TEST(AgentParsers, ExitCodesAreBytes) {
  // exit(256) is exit(0): a code past 255 must never reach exit().
  for (const char* line : {"END 256", "END -1", "END 1000000000", "END ", "END 1 2", "END x"}) {
    Parsed<Node0Message> p = parse_node0_message(line);
    EXPECT_FALSE(p.value) << line;
    EXPECT_NE(p.refusal.find("END <exit code 0..255>"), std::string::npos) << p.refusal;
  }
  ASSERT_TRUE(parse_node0_message("END 255").value);
  EXPECT_EQ(parse_node0_message("END 255").value->code, 255);
  for (const char* line : {"FAILED 256 1 x", "FAILED c 0", "FAILED 3 2 x", "FAILED 3", "FAILED"}) {
    Parsed<NodeMessage> p = parse_node_message(line);
    EXPECT_FALSE(p.value) << line;
    EXPECT_FALSE(p.refusal.empty()) << line;
  }
  Parsed<NodeMessage> failed = parse_node_message("FAILED 7 1 rank 3 exited with status 7");
  ASSERT_TRUE(failed.value);
  EXPECT_EQ(failed.value->code, 7);
  EXPECT_TRUE(failed.value->restartable);
  EXPECT_EQ(failed.value->what, "rank 3 exited with status 7");
}

TEST(AgentParsers, StartAndJoinAreRangeChecked) {
  EXPECT_FALSE(parse_node0_message("START 0 0").value);
  EXPECT_FALSE(parse_node0_message("START 0 65536").value);
  EXPECT_FALSE(parse_node0_message("START -1 29500").value);
  ASSERT_TRUE(parse_node0_message("START 2 29500").value);
  EXPECT_EQ(parse_node0_message("START 2 29500").value->port, 29500);
  EXPECT_FALSE(parse_join("JOIN 1 0 2 0").value);
  EXPECT_FALSE(parse_join("JOIN 1 2 2 0 extra").value);
  EXPECT_FALSE(parse_join("JOIN  1 2 2 0").value);
  EXPECT_FALSE(parse_join("JOIN +1 2 2 0").value);
  ASSERT_TRUE(parse_join("JOIN 1 2 3 4").value);
  EXPECT_EQ(parse_join("JOIN 1 2 3 4").value->nproc, 3);
}

TEST(AgentParsers, UnknownLinesAreNamedSafely) {
  Parsed<NodeMessage> p = parse_node_message("\x1b[2J\x07 boom");
  ASSERT_FALSE(p.value);
  EXPECT_EQ(p.refusal, "an unknown message '\\x1b[2J\\x07'");
}

TEST(Printable, EscapesControlBytesAndCuts) {
  EXPECT_EQ(printable("ok \\ fine"), "ok \\\\ fine");
  EXPECT_EQ(printable(std::string("a\x1b[31mb\r\n\0c", 11)), "a\\x1b[31mb\\x0d\\x0a\\x00c");
  EXPECT_EQ(printable("\xff\x80"), "\\xff\\x80");
  EXPECT_EQ(printable("abcdef", 3), "abc...");
}

TEST(LineBuffer, SplitsAcrossChunksAndRefusesLongLines) {
  LineBuffer buffer(8);
  EXPECT_TRUE(buffer.append("ab", 2));
  EXPECT_TRUE(buffer.append("c\nde\n\nf", 7));
  std::string line;
  ASSERT_TRUE(buffer.next_line(&line));
  EXPECT_EQ(line, "abc");
  ASSERT_TRUE(buffer.next_line(&line));
  EXPECT_EQ(line, "de");
  ASSERT_TRUE(buffer.next_line(&line));
  EXPECT_EQ(line, "");
  EXPECT_FALSE(buffer.next_line(&line));
  // "f" is held: with it, exactly the limit.
  EXPECT_TRUE(buffer.append("1234567\n", 8));
  ASSERT_TRUE(buffer.next_line(&line));
  EXPECT_EQ(line, "f1234567");
}

TEST(LineBuffer, ALineOverTheLimitEndsTheStream) {
  LineBuffer buffer(8);
  EXPECT_TRUE(buffer.append("12345678", 8));
  EXPECT_FALSE(buffer.append("9", 1));
  EXPECT_EQ(buffer.error(), "sent a line longer than 8 bytes");
  EXPECT_FALSE(buffer.append("\nok\n", 4));
  std::string line;
  EXPECT_FALSE(buffer.next_line(&line));
}

// --- the challenge ---

const std::string kJobSecret = "0123456789abcdef-job-secret";

std::string nonce(char fill) { return std::string(kNonceBytes, fill); }
std::string nonce_hex(char fill) {
  return to_hex(reinterpret_cast<const uint8_t*>(nonce(fill).data()), kNonceBytes);
}

TEST(AgentChallenge, BothSidesPassWithTheSameSecret) {
  Node0Gate node0(kJobSecret, nonce('z'));
  FollowerGate node(kJobSecret, nonce('n'));
  GateStep challenge = node0.on_line(node.hello());
  ASSERT_EQ(challenge.status, GateStep::Status::kWaiting) << challenge.refusal;
  GateStep auth = node.on_line(challenge.reply);
  ASSERT_EQ(auth.status, GateStep::Status::kPassed) << auth.refusal;
  EXPECT_EQ(node0.on_line(auth.reply).status, GateStep::Status::kWaiting);
  GateStep join = node0.on_line("JOIN 1 2 4 0");
  ASSERT_EQ(join.status, GateStep::Status::kPassed) << join.refusal;
  EXPECT_EQ(join.join.node, 1);
  EXPECT_EQ(join.join.nproc, 4);
}

TEST(AgentChallenge, Node0RefusesAWrongSecretBeforeReadingJoin) {
  Node0Gate node0(kJobSecret, nonce('z'));
  FollowerGate stranger("another-secret-of-length", nonce('n'));
  GateStep challenge = node0.on_line(stranger.hello());
  // The stranger learns node 0 is not its peer and says so itself.
  EXPECT_EQ(stranger.on_line(challenge.reply).status, GateStep::Status::kRefused);
  // Answering anyway with its own key is refused, and JOIN is never read.
  GateStep auth = node0.on_line("AUTH " + node_mac("another-secret-of-length", nonce_hex('z'),
                                                   nonce_hex('n')));
  EXPECT_EQ(auth.status, GateStep::Status::kRefused);
  EXPECT_EQ(auth.refusal, "failed the challenge (not the job's secret)");
  EXPECT_EQ(node0.on_line("JOIN 1 2 4 0").status, GateStep::Status::kRefused);
}

TEST(AgentChallenge, JoinWithoutTheChallengeIsRefused) {
  Node0Gate node0(kJobSecret, nonce('z'));
  GateStep step = node0.on_line("JOIN 1 2 2 0");
  EXPECT_EQ(step.status, GateStep::Status::kRefused);
  EXPECT_EQ(step.refusal, "not an hprun agent: expected HELLO, got 'JOIN'");
  EXPECT_TRUE(step.reply.empty());
}

TEST(AgentChallenge, FollowerRefusesAnImpostorNode0) {
  for (const std::string& line :
       {std::string("END 0"), std::string("START 0 29500"),
        "CHALLENGE " + nonce_hex('z') + " " + std::string(64, '0'),
        // node 0's MAC over another nonce (a replay) is no answer either
        "CHALLENGE " + nonce_hex('z') + " " + node0_mac(kJobSecret, nonce_hex('m'), nonce_hex('z')),
        // nor the follower's own nonce reflected back
        "CHALLENGE " + nonce_hex('n') + " " + node0_mac(kJobSecret, nonce_hex('n'), nonce_hex('n'))}) {
    FollowerGate node(kJobSecret, nonce('n'));
    GateStep step = node.on_line(line);
    EXPECT_EQ(step.status, GateStep::Status::kRefused) << line;
    EXPECT_TRUE(step.reply.empty()) << line;
  }
}

TEST(AgentChallenge, MacsOfTheTwoSidesDiffer) {
  // One side's MAC is never the other's answer (no reflection).
  EXPECT_NE(node0_mac(kJobSecret, nonce_hex('a'), nonce_hex('b')),
            node_mac(kJobSecret, nonce_hex('a'), nonce_hex('b')));
}

// --- the secret ---

class SecretFile : public ::testing::Test {
 protected:
  std::string write(const std::string& content, mode_t mode) {
    std::string path = dir_.file("secret" + std::to_string(count_++));
    int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL, 0600);
    EXPECT_GE(fd, 0);
    EXPECT_EQ(::write(fd, content.data(), content.size()), static_cast<ssize_t>(content.size()));
    ::fchmod(fd, mode);
    ::close(fd);
    return path;
  }
  std::string error(const std::string& file, const char* env) {
    try {
      load_rdzv_secret(file, env);
    } catch (const std::invalid_argument& e) {
      return e.what();
    }
    return "";
  }
  TempDir dir_;
  int count_ = 0;
};

TEST_F(SecretFile, ReadsAPrivateFileWithoutItsNewline) {
  EXPECT_EQ(load_rdzv_secret(write("0123456789abcdefXYZ\n", 0600), nullptr), "0123456789abcdefXYZ");
  EXPECT_EQ(load_rdzv_secret(write("0123456789abcdef", 0400), "ignored-when-a-file-is-given"),
            "0123456789abcdef");
}

TEST_F(SecretFile, RefusesAFileOthersMayRead) {
  for (mode_t mode : {0640, 0604, 0660, 0606}) {
    std::string message = error(write("0123456789abcdef", mode), nullptr);
    EXPECT_NE(message.find("readable by its owner only (chmod 600)"), std::string::npos)
        << mode << ": " << message;
  }
}

TEST_F(SecretFile, RefusesShortLongMissingAndOddFiles) {
  EXPECT_NE(error(write("short\n", 0600), nullptr).find("must hold 16..4096 bytes"),
            std::string::npos);
  EXPECT_NE(error(write(std::string(5000, 'x'), 0600), nullptr).find("must hold"),
            std::string::npos);
  EXPECT_NE(error(dir_.file("absent"), nullptr).find("cannot open it"), std::string::npos);
  EXPECT_NE(error(dir_.path(), nullptr).find("regular file"), std::string::npos);
  std::string link = dir_.file("link");
  ASSERT_EQ(::symlink(write("0123456789abcdef", 0600).c_str(), link.c_str()), 0);
  EXPECT_NE(error(link, nullptr).find("cannot open it"), std::string::npos);
}

TEST_F(SecretFile, EnvironmentIsTheFallbackAndNeitherIsAnError) {
  EXPECT_EQ(load_rdzv_secret("", "0123456789abcdef"), "0123456789abcdef");
  EXPECT_NE(error("", "short").find("HPRUN_RDZV_SECRET must hold 16..4096 bytes, got 5"),
            std::string::npos);
  std::string message = error("", nullptr);
  EXPECT_NE(message.find("--rdzv-secret-file"), std::string::npos) << message;
  EXPECT_NE(message.find("HPRUN_RDZV_SECRET"), std::string::npos) << message;
}

}  // namespace
}  // namespace hp::launcher::testing
