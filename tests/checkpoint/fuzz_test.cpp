// Mutation fuzzing of the readers of untrusted checkpoint text (C8 in
// docs/features.md): the safetensors reader and the metadata.json parser.
// libFuzzer is not available with the project's compiler, so this is a
// seeded loop under GoogleTest: a fixed seed and a fixed number of inputs,
// each a few random mutations (bit flips, brackets, numbers at the edges of
// int64 and uint64, cut and copied spans, splices, deep nesting) of a seed
// corpus of valid files and the crafted ones of readers_test.cpp. Half of
// the mutated inputs get a consistent length prefix or checksum again, so
// that the checks behind those are reached too.
//
// The property: every input parses, or raises the reader's named error
// (SafetensorsError, CheckpointError); nothing else escapes, nothing
// crashes or hangs; what parses describes tensors no larger than the file
// (safetensors) or chunks inside their tensor that cover it exactly
// (metadata), computed here in 128-bit arithmetic. A failure prints the
// iteration and leaves the input in the test's temp directory.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <stdlib.h>

#include <nlohmann/json.hpp>

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "hp/checkpoint/errors.h"
#include "hp/checkpoint/metadata.h"
#include "hp/checkpoint/read_limits.h"
#include "hp/checkpoint/safetensors.h"
#include "hp/util/error.h"
#include "tests/checkpoint/hostile_inputs.h"

namespace hp::checkpoint {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::ordered_json;

constexpr uint64_t kSeed = 20240607;
// Inputs per reader: both readers together take about 6 s on one core of the
// (shared, slow) machine the tests were written on.
constexpr int kIterations = 100000;
constexpr size_t kMaxInputBytes = 1 << 16;

const char* const kNumbers[] = {"0",
                                "1",
                                "-1",
                                "4294967296",
                                "9223372036854775807",
                                "9223372036854775808",
                                "-9223372036854775808",
                                "18446744073709551615",
                                "18446744073709551616",
                                "1e308",
                                "0.5"};
const char kBytes[] = "[]{}\":,\\-0123456789 \x00\xff";

class Mutator {
 public:
  explicit Mutator(uint64_t seed) : rng_(seed) {}

  size_t below(size_t n) { return n == 0 ? 0 : static_cast<size_t>(rng_() % n); }

  std::string mutate(std::string s, const std::vector<std::string>& corpus) {
    // Mostly one mutation, so that many inputs still parse and reach the
    // checks behind the parser; sometimes a few.
    const size_t rounds = below(4) == 0 ? 2 + below(3) : 1;
    for (size_t r = 0; r < rounds; ++r) {
      const size_t at = below(s.size() + 1);
      switch (below(8)) {
        case 0:  // flip a bit
          if (!s.empty()) s[below(s.size())] ^= static_cast<char>(1 << below(8));
          break;
        case 1:  // a byte the grammar cares about
          if (!s.empty()) s[below(s.size())] = kBytes[below(sizeof(kBytes) - 1)];
          break;
        case 2: {  // copy a span elsewhere
          const size_t from = below(s.size() + 1);
          const std::string span = s.substr(from, below(64));
          s.insert(at, span);
          break;
        }
        case 3:  // cut a span
          s.erase(at, below(16));
          break;
        case 4:  // a number at an edge, in place of one of the input's
        case 7:  // (twice as often: every size, offset and dim is a number)
          replace_number(s);
          break;
        case 5: {  // splice with another input
          const std::string& other = corpus[below(corpus.size())];
          s = s.substr(0, at) + other.substr(below(other.size() + 1));
          break;
        }
        case 6:  // nesting, around the limit or far beyond it
          s.insert(at, test::nested(below(2) ? 60 + below(10) : below(5000)));
          break;
      }
    }
    if (s.size() > kMaxInputBytes) s.resize(kMaxInputBytes);
    return s;
  }

 private:
  void replace_number(std::string& s) {
    std::vector<size_t> starts;
    for (size_t i = 0; i < s.size(); ++i) {
      const bool digit = s[i] >= '0' && s[i] <= '9';
      const bool after_digit = i > 0 && s[i - 1] >= '0' && s[i - 1] <= '9';
      if (digit && !after_digit) starts.push_back(i);
    }
    if (starts.empty()) return;
    const size_t begin = starts[below(starts.size())];
    size_t end = begin;
    while (end < s.size() && s[end] >= '0' && s[end] <= '9') ++end;
    s.replace(begin, end - begin, kNumbers[below(std::size(kNumbers))]);
  }

  std::mt19937_64 rng_;
};

class ReaderFuzz : public testing::Test {
 protected:
  void SetUp() override {
    char pattern[] = "/tmp/hp_fuzz_XXXXXX";
    ASSERT_NE(::mkdtemp(pattern), nullptr);
    dir_ = pattern;
  }
  void TearDown() override {
    if (!HasFailure()) fs::remove_all(dir_);
  }
  std::string file(const std::string& name) const { return dir_ + "/" + name; }
  static std::string slurp(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), {});
  }
  void keep(const std::string& name, const std::string& bytes) const {
    std::ofstream(file(name), std::ios::binary) << bytes;
  }

  std::string dir_;
};

// The header text of a safetensors file (after its 8-byte length).
std::string header_of(const std::string& bytes) {
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(bytes[i]);
  return bytes.substr(8, n);
}

TEST_F(ReaderFuzz, SafetensorsReaderParsesOrRaisesItsError) {
  // Seeds: files of the writer (every dtype, empty and 0-d tensors,
  // metadata) and crafted headers.
  std::vector<std::string> files;
  write_safetensors(file("a"), {{"f32", at::arange(6, at::kFloat).reshape({2, 3})},
                                {"i64", at::arange(3, at::kLong)},
                                {"bool", at::ones({2}, at::kBool)},
                                {"empty", at::zeros({0, 4}, at::kHalf)},
                                {"scalar", at::ones({}, at::kDouble)}},
                    {{"format", "pt"}});
  files.push_back(slurp(file("a")));
  write_safetensors(file("b"), {{"w", at::ones({4, 4}, at::kBFloat16)}});
  files.push_back(slurp(file("b")));
  for (const std::string& header :
       {std::string(R"({"w":{"dtype":"F32","shape":[0,4294967296,4294967296],"data_offsets":[0,0]}})"),
        std::string(R"({"w":{"dtype":"F64","shape":[4294967296,4294967296],"data_offsets":[0,0]}})"),
        std::string(R"({"w":{"dtype":"U8","shape":[2],"data_offsets":[18446744073709551615,1]}})"),
        std::string(R"({"__metadata__":)") + test::nested(70) + "}",
        std::string(R"({"w":{"dtype":"I8","shape":[1],"data_offsets":[0,1]},"w":{}})")}) {
    files.push_back(test::safetensors_bytes(header, "x"));
  }
  std::vector<std::string> headers;
  for (const std::string& f : files) headers.push_back(header_of(f));

  Mutator m(kSeed);
  const std::string path = file("input.safetensors");
  int parsed = 0, refused = 0;
  for (int i = 0; i < kIterations; ++i) {
    const std::string& seed = files[m.below(files.size())];
    std::string input;
    if (m.below(2)) {
      // A mutated header under its own length, with the corpus input's data.
      const std::string header = header_of(seed);
      input = test::safetensors_bytes(m.mutate(header, headers),
                                      seed.substr(std::min(seed.size(), 8 + header.size())));
    } else {
      input = m.mutate(seed, files);
    }
    // A new file each time: ext4 flushes a file truncated and rewritten
    // when it is closed (auto_da_alloc), which would make this loop wait on
    // the disk.
    fs::remove(path);
    std::ofstream(path, std::ios::binary) << input;
    try {
      const SafetensorsFile read = read_safetensors(path);
      uint64_t bytes = 0;
      for (const auto& [name, t] : read.tensors) bytes += t.nbytes();
      ASSERT_LE(bytes, input.size()) << "iteration " << i;
      ++parsed;
    } catch (const SafetensorsError&) {
      ++refused;
    } catch (const std::exception& e) {
      keep("failing.safetensors", input);
      FAIL() << "iteration " << i << ": " << exception_message(e) << " (input in "
             << file("failing.safetensors") << ")";
    }
  }
  // Both outcomes are reached: the loop does not stop at the first check.
  EXPECT_GT(parsed, 0) << parsed << " parsed, " << refused << " refused";
  EXPECT_GT(refused, 0) << parsed << " parsed, " << refused << " refused";
  std::printf("%d inputs: %d parsed, %d refused\n", kIterations, parsed, refused);
}

// What a parsed metadata promises, recomputed without overflow.
void expect_chunks_tile(const Metadata& m, int iteration) {
  for (const auto& [key, t] : m.tensors) {
    __int128 numel = 1;
    for (int64_t d : t.shape) numel *= d;
    __int128 covered = 0;
    for (const ChunkRecord& c : t.chunks) {
      ASSERT_EQ(c.offsets.size(), t.shape.size()) << "iteration " << iteration;
      __int128 n = 1;
      for (size_t d = 0; d < t.shape.size(); ++d) {
        ASSERT_LE(static_cast<__int128>(c.offsets[d]) + c.sizes[d], t.shape[d])
            << "iteration " << iteration << ": tensor '" << key << "'";
        n *= c.sizes[d];
      }
      covered += n;
      const FileRecord& f = m.files.at(c.file);
      ASSERT_LE(static_cast<__int128>(c.byte_offset) + c.bytes, f.bytes) << "iteration " << iteration;
    }
    ASSERT_TRUE(covered == numel) << "iteration " << iteration << ": tensor '" << key << "'";
  }
}

TEST_F(ReaderFuzz, MetadataParserParsesOrRaisesItsError) {
  std::vector<std::string> corpus;
  Json body = test::small_metadata();
  corpus.push_back(test::with_checksum(body));
  // Two tensors, one in a 2 x 2 grid of chunks over two files.
  body["files"]["rank-00001.safetensors"] = {{"bytes", 88}, {"header_bytes", 72}};
  Json grid = Json::array();
  for (int i = 0; i < 2; ++i) {
    for (int j = 0; j < 2; ++j) {
      grid.push_back({{"offsets", {2 * i, j}}, {"sizes", {2, 1}},
                      {"file", i ? "rank-00001.safetensors" : "rank-00000.safetensors"},
                      {"byte_offset", 72 + 8 * j}, {"bytes", 8}, {"crc32c", 12345}});
    }
  }
  body["tensors"]["g"] = {{"dtype", "F32"}, {"shape", {4, 2}}, {"layout", "l"}, {"chunks", grid}};
  corpus.push_back(test::with_checksum(body));
  // Crafted: a chunk at INT64_MAX, a negative step, deep nesting.
  Json crafted = test::small_metadata();
  crafted["tensors"]["w"]["chunks"][0]["offsets"] = {INT64_MAX};
  corpus.push_back(test::with_checksum(crafted));
  crafted = test::small_metadata();
  crafted["step"] = -1;
  corpus.push_back(test::with_checksum(crafted));
  corpus.push_back(R"({"crc32c":0,"x":)" + test::nested(70) + "}");

  Mutator m(kSeed + 1);
  int parsed = 0, refused = 0;
  for (int i = 0; i < kIterations; ++i) {
    std::string input = m.mutate(corpus[m.below(corpus.size())], corpus);
    if (m.below(2) && !json_too_deep(input)) {
      // The checksum again, so that the fields behind it are checked. (The
      // depth check first: this test's own dump() would recurse too.)
      const Json fixed = Json::parse(input, nullptr, /*allow_exceptions=*/false);
      if (fixed.is_object()) input = test::with_checksum(fixed);
    }
    try {
      const Metadata metadata = Metadata::parse(input, "fuzz.json");
      expect_chunks_tile(metadata, i);
      if (HasFatalFailure()) {
        keep("failing.json", input);
        return;
      }
      ++parsed;
    } catch (const CheckpointError&) {
      ++refused;
    } catch (const std::exception& e) {
      keep("failing.json", input);
      FAIL() << "iteration " << i << ": " << exception_message(e) << " (input in "
             << file("failing.json") << ")";
    }
  }
  EXPECT_GT(parsed, 0) << parsed << " parsed, " << refused << " refused";
  EXPECT_GT(refused, 0) << parsed << " parsed, " << refused << " refused";
  std::printf("%d inputs: %d parsed, %d refused\n", kIterations, parsed, refused);
}

}  // namespace
}  // namespace hp::checkpoint
