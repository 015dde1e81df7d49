// hp-train's data: the batch rule (offsets, wrap-around, rank slices), the
// uint16 token files and the fortunes corpus.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <stdlib.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

#include "hp/util/error.h"
#include "tests/support/tensor_checks.h"
#include "tools/hp_train/batches.h"
#include "tools/hp_train/corpus.h"

namespace hp::train {
namespace {

namespace fs = std::filesystem;

using testing::AllOf;
using testing::HasSubstr;
using testing::ThrowsMessage;

// With tokens 0..len-1 every window's first input is its start offset.
at::Tensor positions(int64_t len) { return at::arange(len, at::kLong); }

TEST(Batches, WindowsStartWhereTheRuleSays) {
  const int64_t len = 100, B = 4, T = 8, M = len - T - 1;  // M = 91
  at::Tensor tokens = positions(len);
  for (int64_t step : {0, 1, 2, 3, 7, 50}) {
    Batch b = batch_for_step(tokens, step, B, T, 0, 1);
    ASSERT_EQ(b.inputs.sizes(), (at::IntArrayRef{B, T}));
    ASSERT_EQ(b.targets.sizes(), (at::IntArrayRef{B, T}));
    for (int64_t i = 0; i < B; ++i) {
      const int64_t start = ((step * B + i) * T) % M;
      EXPECT_TRUE(test::tensors_equal(b.inputs[i], at::arange(start, start + T, at::kLong)))
          << "step " << step << " sample " << i;
      EXPECT_TRUE(test::tensors_equal(b.targets[i], at::arange(start + 1, start + T + 1, at::kLong)))
          << "step " << step << " sample " << i;
    }
  }
}

TEST(Batches, OffsetsWrapAroundTheCorpus) {
  // len 20, T 4: offsets are taken mod 15, so step 1 (samples 3..5, raw
  // offsets 12, 16, 20) wraps to 12, 1, 5.
  Batch b = batch_for_step(positions(20), 1, 3, 4, 0, 1);
  EXPECT_TRUE(test::tensors_equal(b.inputs.select(1, 0), at::tensor({12, 1, 5}, at::kLong)));
  // The last window may end on the last-but-one token, never past it.
  for (int64_t step = 0; step < 40; ++step) {
    Batch b1 = batch_for_step(positions(20), step, 1, 4, 0, 1);
    EXPECT_LE(b1.targets.max().item<int64_t>(), 18) << "step " << step;
  }
  // The smallest legal corpus: every offset is 0.
  Batch tiny = batch_for_step(positions(6), 9, 2, 4, 0, 1);
  EXPECT_TRUE(test::tensors_equal(tiny.inputs, positions(4).repeat({2, 1})));
  EXPECT_TRUE(test::tensors_equal(tiny.targets, at::arange(1, 5, at::kLong).repeat({2, 1})));
}

TEST(Batches, HugeStepsStayExact) {
  // (s*B + i)*T mod M depends on s only mod M: step s0 + k*M is step s0.
  const int64_t len = 1000, B = 6, T = 16, M = len - T - 1;
  const int64_t s0 = 5, k = (INT64_MAX - s0) / M;
  Batch small = batch_for_step(positions(len), s0, B, T, 0, 1);
  Batch huge = batch_for_step(positions(len), s0 + k * M, B, T, 0, 1);
  EXPECT_TRUE(test::tensors_equal(huge.inputs, small.inputs));
}

TEST(Batches, RankSlicesConcatenateToTheGlobalBatch) {
  at::Tensor tokens = at::randint(0, 256, {5000}, at::kLong);
  const int64_t B = 12, T = 32;
  for (int64_t step : {0, 3, 17}) {
    Batch global = batch_for_step(tokens, step, B, T, 0, 1);
    for (int64_t D : {2, 3, 4, 6, 12}) {
      std::vector<at::Tensor> inputs, targets;
      for (int64_t r = 0; r < D; ++r) {
        Batch part = batch_for_step(tokens, step, B, T, r, D);
        EXPECT_EQ(part.inputs.size(0), B / D);
        inputs.push_back(part.inputs);
        targets.push_back(part.targets);
      }
      EXPECT_TRUE(test::tensors_equal(at::cat(inputs), global.inputs)) << "D=" << D;
      EXPECT_TRUE(test::tensors_equal(at::cat(targets), global.targets)) << "D=" << D;
    }
    EXPECT_TRUE(test::tensors_equal(global.inputs.slice(1, 1), global.targets.slice(1, 0, T - 1)));
  }
}

TEST(Batches, BadArgumentsNameTheArgumentValueAndExpectation) {
  at::Tensor tokens = positions(100);
  // batch_for_step's verdict on (step, B, T, r, D, tokens) is an
  // ArgumentError whose message holds `part`.
  auto expect_refused = [&](int64_t step, int64_t B, int64_t T, int64_t r, int64_t D,
                            const at::Tensor& t, const std::string& part) {
    EXPECT_THAT([&] { batch_for_step(t, step, B, T, r, D); },
                ThrowsMessage<ArgumentError>(HasSubstr(part)));
  };
  expect_refused(0, 6, 8, 0, 4, tokens, "global_batch 6 must be divisible by dp_size 4");
  expect_refused(0, 4, 0, 0, 1, tokens, "seq_len must be >= 1 but got 0");
  expect_refused(0, 4, 99, 0, 1, tokens, "must hold at least seq_len + 2 = 101 tokens but has 100");
  expect_refused(-1, 4, 8, 0, 1, tokens, "step must be >= 0 but got -1");
  expect_refused(0, 0, 8, 0, 1, tokens, "global_batch must be >= 1 but got 0");
  expect_refused(0, 4, 8, 0, 0, tokens, "dp_size must be >= 1 but got 0");
  expect_refused(0, 4, 8, 2, 2, tokens, "dp_rank must be in [0, 2) but got 2");
  expect_refused(0, 4, 8, 0, 1, tokens.to(at::kInt),
                 "tokens must be a 1-D int64 CPU tensor but got Int of shape [100]");
  expect_refused(0, 4, 8, 0, 1, tokens.reshape({10, 10}), "Long of shape [10, 10]");
}

class TokenFiles : public testing::Test {
 protected:
  void SetUp() override {
    char pattern[] = "/tmp/hp_train_data_XXXXXX";
    ASSERT_NE(::mkdtemp(pattern), nullptr);
    dir_ = pattern;
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string write(const std::string& name, const std::string& bytes) {
    std::string path = dir_ + "/" + name;
    std::ofstream(path, std::ios::binary) << bytes;
    return path;
  }
  static std::string uint16s(const std::vector<int>& values) {
    std::string bytes;
    for (int v : values) {
      bytes.push_back(static_cast<char>(v & 0xff));
      bytes.push_back(static_cast<char>(v >> 8));
    }
    return bytes;
  }
  // Loading `path` with `vocab` raises an ArgumentError matching `matcher`.
  template <typename Matcher>
  void expect_refused(const std::string& path, int64_t vocab, Matcher matcher) {
    EXPECT_THAT([&] { load_token_file(path, vocab); }, ThrowsMessage<ArgumentError>(matcher));
  }

  std::string dir_;
};

TEST_F(TokenFiles, ReadsLittleEndianUint16) {
  std::string path = write("t.bin", uint16s({0, 1, 255, 256, 50000, 65535}));
  Corpus c = load_token_file(path, 65536);
  EXPECT_TRUE(test::tensors_equal(c.tokens, at::tensor({0, 1, 255, 256, 50000, 65535}, at::kLong)));
  EXPECT_EQ(c.vocab_size, 65536);
  EXPECT_THAT(c.description, AllOf(HasSubstr(path), HasSubstr("6 uint16 tokens")));
}

TEST_F(TokenFiles, RejectsBadFiles) {
  std::string bad = write("bad.bin", uint16s({3, 7, 300, 2, 400}));
  expect_refused(bad, 256,
                 AllOf(HasSubstr(bad),
                       HasSubstr("token at position 2 is 300, not below --vocab 256")));

  std::string odd = write("odd.bin", std::string("\x01\x00\x02", 3));
  expect_refused(odd, 256, HasSubstr("has 3 bytes, an odd number"));
  expect_refused(write("empty.bin", ""), 256, HasSubstr("is empty"));
  expect_refused(dir_ + "/absent.bin", 256, HasSubstr("absent.bin' is not a readable file"));
  expect_refused(bad, 0, HasSubstr("--vocab must be in [1, 65536] for uint16 tokens but got 0"));
  expect_refused(bad, 70000, HasSubstr("but got 70000"));
}

TEST_F(TokenFiles, FortunesTakesPlainFilesInSortedOrder) {
  fs::create_directory(dir_ + "/off");
  write("off/rude", "no");
  write("zeta", "Z!");
  write("alpha", "ab");
  write("alpha.dat", "index");
  write("beta.u8", "dup");
  fs::create_symlink(dir_ + "/zeta", dir_ + "/zeta.u8");
  Corpus c = load_fortunes(dir_);
  EXPECT_TRUE(test::tensors_equal(c.tokens, at::tensor({'a', 'b', 'Z', '!'}, at::kLong)));
  EXPECT_EQ(c.vocab_size, 256);
  EXPECT_THAT(c.description, HasSubstr("2 files"));
}

TEST_F(TokenFiles, FortunesMissingNamesThePackage) {
  EXPECT_THAT([&] { load_fortunes(dir_ + "/nope"); },
              ThrowsMessage<std::runtime_error>(
                  AllOf(HasSubstr(dir_ + "/nope"),
                        HasSubstr("install the 'fortunes' package: scripts/install-deps.sh"))));
  EXPECT_THAT([&] { load_fortunes(dir_); },
              ThrowsMessage<std::runtime_error>(HasSubstr("holds no fortune files")));
}

TEST(Fortunes, DebianCorpusLoadsAsBytes) {
  ASSERT_TRUE(fs::is_directory(kFortunesDir))
      << "install the 'fortunes' package: scripts/install-deps.sh";
  Corpus c = load_fortunes();
  ASSERT_EQ(c.tokens.dim(), 1);
  EXPECT_EQ(c.tokens.scalar_type(), at::kLong);
  EXPECT_GT(c.tokens.numel(), 1000000);
  EXPECT_GE(c.tokens.min().item<int64_t>(), 0);
  EXPECT_LT(c.tokens.max().item<int64_t>(), 256);

  // Deterministic: the plain files' sizes add up, and a second load is equal.
  int64_t bytes = 0;
  for (const auto& e : fs::directory_iterator(kFortunesDir)) {
    if (e.is_regular_file() && e.path().filename().string().find('.') == std::string::npos) {
      bytes += static_cast<int64_t>(e.file_size());
    }
  }
  EXPECT_EQ(c.tokens.numel(), bytes);
  EXPECT_TRUE(test::tensors_equal(load_fortunes().tokens, c.tokens));
  std::cout << "fortunes corpus: " << c.description << std::endl;
}

}  // namespace
}  // namespace hp::train
