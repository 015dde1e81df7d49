// safetensors files: round trips of every dtype, the layout the format
// prescribes, every malformed file and bad argument, atomic replacement, and
// interoperability with an independent Python implementation of the format.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <stdlib.h>
#include <sys/wait.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "hp/checkpoint/safetensors.h"
#include "hp/util/error.h"
#include "tests/support/tensor_checks.h"

namespace hp::checkpoint {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::StrEq;
using ::testing::ThrowsMessage;

namespace fs = std::filesystem;
using Named = std::vector<std::pair<std::string, at::Tensor>>;

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// A file with this header text and data section, as a foreign writer made it.
void write_raw(const std::string& path, const std::string& header, const std::string& data) {
  std::ofstream out(path, std::ios::binary);
  uint64_t n = header.size();
  out.write(reinterpret_cast<const char*>(&n), 8);
  out << header << data;
}

uint64_t header_length(const std::string& path) {
  std::string bytes = slurp(path);
  uint64_t n = 0;
  std::memcpy(&n, bytes.data(), 8);
  return n;
}

// Same dtype, shape and bytes (NaN payloads and -0.0 included).
testing::AssertionResult same_bits(const at::Tensor& actual, const at::Tensor& expected) {
  if (actual.scalar_type() != expected.scalar_type() || actual.sizes() != expected.sizes()) {
    return testing::AssertionFailure() << actual.scalar_type() << actual.sizes() << " vs "
                                       << expected.scalar_type() << expected.sizes();
  }
  at::Tensor a = actual.contiguous(), e = expected.contiguous();
  if (e.nbytes() > 0 && std::memcmp(a.data_ptr(), e.data_ptr(), e.nbytes()) != 0) {
    return testing::AssertionFailure() << "bytes differ: " << actual << " vs " << expected;
  }
  return testing::AssertionSuccess();
}

// at::tensor has no bool overload in libtorch 1.13.
at::Tensor bools(std::vector<int> values) { return at::tensor(values, at::kInt).to(at::kBool); }

// One tensor of every supported dtype, with values that stress its bits.
Named every_dtype() {
  at::manual_seed(7);
  auto bits16 = [](int64_t n) { return at::randint(-32768, 32768, {n}, at::kShort); };
  return {
      {"f64", at::randn({3, 4}, at::kDouble)},
      {"f32", at::tensor({0.0f, -0.0f, 1e-40f, INFINITY, -INFINITY, NAN, 3.5f})},
      {"f16", bits16(64).view(at::kHalf).reshape({8, 8})},
      {"bf16", bits16(64).view(at::kBFloat16).reshape({4, 16})},
      {"i64", at::tensor({INT64_MIN, int64_t{-1}, int64_t{0}, INT64_MAX})},
      {"i32", at::randint(INT32_MIN, INT32_MAX, {5}, at::kInt)},
      {"i16", bits16(6)},
      {"i8", at::arange(-128, 128, at::kChar).reshape({16, 16})},
      {"u8", at::arange(0, 256, at::kInt).to(at::kByte)},
      {"bool", bools({1, 0, 0, 1})},
  };
}

class SafetensorsTest : public testing::Test {
 protected:
  void SetUp() override {
    char pattern[] = "/tmp/hp_safetensors_XXXXXX";
    ASSERT_NE(::mkdtemp(pattern), nullptr);
    dir_ = pattern;
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string file(const std::string& name) const { return dir_ + "/" + name; }
  std::vector<std::string> directory_listing() const {
    std::vector<std::string> names;
    for (const auto& e : fs::directory_iterator(dir_)) names.push_back(e.path().filename());
    std::sort(names.begin(), names.end());
    return names;
  }
  // Reading `path`, as a call for EXPECT_THAT(..., ThrowsMessage<...>(...)).
  static std::function<void()> reading(const std::string& path) {
    return [path] { read_safetensors(path); };
  }
  // Writes a file with this header and `data_bytes` zero bytes of data now,
  // and returns the call that reads it.
  std::function<void()> reading_bad(const std::string& header, size_t data_bytes = 0) {
    std::string path = file("bad.safetensors");
    write_raw(path, header, std::string(data_bytes, '\0'));
    return reading(path);
  }

  std::string dir_;
};

TEST_F(SafetensorsTest, RoundTripsEveryDtypeBitExactly) {
  Named tensors = every_dtype();
  write_safetensors(file("all.safetensors"), tensors);
  SafetensorsFile back = read_safetensors(file("all.safetensors"));
  ASSERT_EQ(back.tensors.size(), tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    EXPECT_EQ(back.tensors[i].first, tensors[i].first);
    EXPECT_TRUE(same_bits(back.tensors[i].second, tensors[i].second)) << tensors[i].first;
  }
  EXPECT_TRUE(back.metadata.empty());
}

TEST_F(SafetensorsTest, EmptyTensorsAndScalars) {
  Named tensors = {{"scalar_f", at::scalar_tensor(2.5, at::kFloat)},
                   {"empty_rows", at::empty({0, 3})},
                   {"scalar_i", at::scalar_tensor(-9, at::kLong)},
                   {"empty", at::empty({0}, at::kBFloat16)},
                   {"empty_too", at::empty({2, 0}, at::kBool)},
                   {"last", at::ones({2}, at::kShort)}};
  write_safetensors(file("e.safetensors"), tensors);
  SafetensorsFile back = read_safetensors(file("e.safetensors"));
  ASSERT_EQ(back.tensors.size(), tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    EXPECT_EQ(back.tensors[i].first, tensors[i].first);
    EXPECT_TRUE(same_bits(back.tensors[i].second, tensors[i].second)) << tensors[i].first;
  }
  EXPECT_EQ(back.tensors[0].second.dim(), 0);
}

TEST_F(SafetensorsTest, NoTensorsAtAll) {
  write_safetensors(file("none.safetensors"), {}, {{"k", "v"}});
  SafetensorsFile back = read_safetensors(file("none.safetensors"));
  EXPECT_TRUE(back.tensors.empty());
  EXPECT_EQ(back.metadata.at("k"), "v");
}

TEST_F(SafetensorsTest, MetadataRoundTrips) {
  std::map<std::string, std::string> metadata = {
      {"format", "pt"}, {"step", "1200"}, {"note", "größe \"quoted\" \n newline"}, {"", "empty key"}};
  write_safetensors(file("m.safetensors"), {{"w", at::ones({2})}}, metadata);
  EXPECT_EQ(read_safetensors(file("m.safetensors")).metadata, metadata);

  // Without metadata the header has no __metadata__ entry at all.
  write_safetensors(file("n.safetensors"), {{"w", at::ones({2})}});
  EXPECT_EQ(slurp(file("n.safetensors")).find("__metadata__"), std::string::npos);
}

TEST_F(SafetensorsTest, DataStartsEightByteAlignedAfterSpacePadding) {
  for (int length = 1; length <= 16; ++length) {
    std::string path = file("a.safetensors");
    write_safetensors(path, {{std::string(length, 'x'), at::ones({3}, at::kByte)}});
    uint64_t n = header_length(path);
    EXPECT_EQ((8 + n) % 8, 0u) << "name length " << length;
    std::string header = slurp(path).substr(8, n);
    size_t close = header.rfind('}');
    EXPECT_EQ(header.find_first_not_of(' ', close + 1), std::string::npos) << header;
    EXPECT_EQ(slurp(path).size(), 8 + n + 3);
  }
}

TEST_F(SafetensorsTest, TensorsComeBackInWrittenOrder) {
  Named tensors = {{"z", at::ones({2})}, {"a", at::zeros({3}, at::kLong)}, {"m", at::ones({1})}};
  write_safetensors(file("o.safetensors"), tensors);
  SafetensorsFile back = read_safetensors(file("o.safetensors"));
  ASSERT_EQ(back.tensors.size(), 3u);
  EXPECT_EQ(back.tensors[0].first, "z");
  EXPECT_EQ(back.tensors[1].first, "a");
  EXPECT_EQ(back.tensors[2].first, "m");
}

TEST_F(SafetensorsTest, WritesContiguousDetachedCopies) {
  at::Tensor base = at::arange(12, at::kFloat).reshape({3, 4}).requires_grad_(true);
  at::Tensor transposed = base.t();
  write_safetensors(file("t.safetensors"), {{"t", transposed}, {"slice", base.select(1, 2)}});
  SafetensorsFile back = read_safetensors(file("t.safetensors"));
  EXPECT_TRUE(test::tensors_equal(back.tensors[0].second, transposed.detach().contiguous()));
  EXPECT_TRUE(test::tensors_equal(back.tensors[1].second, at::tensor({2.f, 6.f, 10.f})));
  EXPECT_FALSE(back.tensors[0].second.requires_grad());
}

// A header entry as other writers spell it: whitespace, any key order.
TEST_F(SafetensorsTest, ReadsForeignHeadersOutOfOrder) {
  std::string header =
      R"({ "b" : {"data_offsets":[4, 12], "shape":[2], "dtype":"I32"},
           "a":{"dtype":"U8","shape":[2,2],"data_offsets":[0,4]} ,
           "__metadata__": {"x": "y"} }   )";
  std::string data = "\x01\x02\x03\x04";
  int32_t ints[2] = {-7, 1 << 20};
  data.append(reinterpret_cast<const char*>(ints), 8);
  write_raw(file("f.safetensors"), header, data);
  SafetensorsFile back = read_safetensors(file("f.safetensors"));
  ASSERT_EQ(back.tensors.size(), 2u);
  EXPECT_EQ(back.tensors[0].first, "a");
  EXPECT_TRUE(test::tensors_equal(back.tensors[0].second,
                                  at::tensor({1, 2, 3, 4}, at::kByte).reshape({2, 2})));
  EXPECT_TRUE(test::tensors_equal(back.tensors[1].second, at::tensor({-7, 1 << 20}, at::kInt)));
  EXPECT_EQ(back.metadata.at("x"), "y");
}

TEST_F(SafetensorsTest, BoolBytesOtherThanOneReadAsTrue) {
  write_raw(file("b.safetensors"), R"({"b":{"dtype":"BOOL","shape":[3],"data_offsets":[0,3]}})",
            std::string("\x00\x01\x07", 3));
  at::Tensor b = read_safetensors(file("b.safetensors")).tensors[0].second;
  EXPECT_TRUE(test::tensors_equal(b, bools({0, 1, 1})));
}

// ---- malformed files ---------------------------------------------------------

TEST_F(SafetensorsTest, MissingFile) {
  EXPECT_THAT(reading(file("absent.safetensors")),
              ThrowsMessage<SafetensorsError>(
                  AllOf(HasSubstr(file("absent.safetensors")), HasSubstr("No such file"))));
}

TEST_F(SafetensorsTest, TruncatedHeaderLength) {
  std::ofstream(file("short.safetensors"), std::ios::binary) << "abcde";
  EXPECT_THAT(reading(file("short.safetensors")),
              ThrowsMessage<SafetensorsError>(
                  AllOf(HasSubstr(file("short.safetensors")), HasSubstr("truncated: 5 bytes"))));
}

TEST_F(SafetensorsTest, HeaderLongerThanFile) {
  std::string path = file("long.safetensors");
  write_raw(path, R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}})", "x");
  std::string bytes = slurp(path);
  bytes.resize(40);  // cut inside the header
  std::ofstream(path, std::ios::binary) << bytes;
  EXPECT_THAT(reading(path),
              ThrowsMessage<SafetensorsError>(AllOf(
                  HasSubstr(path), HasSubstr("header length 53 is larger than the 32 bytes"))));
}

TEST_F(SafetensorsTest, BadJson) {
  EXPECT_THAT(reading_bad(R"({"a": {"dtype": "F32",)"),
              ThrowsMessage<SafetensorsError>(HasSubstr("header is not valid JSON")));
  EXPECT_THAT(reading_bad("[1, 2]"), ThrowsMessage<SafetensorsError>(
                                         HasSubstr("header must be a JSON object but is a array")));
}

TEST_F(SafetensorsTest, UnknownDtype) {
  EXPECT_THAT(
      reading_bad(R"({"w":{"dtype":"F8_E4M3","shape":[2],"data_offsets":[0,2]}})", 2),
      ThrowsMessage<SafetensorsError>(
          AllOf(HasSubstr("tensor 'w' in "),
                HasSubstr("unknown dtype \"F8_E4M3\"; supported: ['F64', 'F32', 'F16', 'BF16'"))));
}

TEST_F(SafetensorsTest, ShapeThatDisagreesWithOffsets) {
  std::string path = file("bad.safetensors");
  EXPECT_THAT(
      reading_bad(
          R"({"h.0.attn.c_attn.weight":{"dtype":"F32","shape":[96,32],"data_offsets":[0,100]}})",
          100),
      ThrowsMessage<SafetensorsError>(
          StrEq("tensor 'h.0.attn.c_attn.weight' in " + path +
                ": shape [96, 32] of F32 needs 12288 bytes but data_offsets [0, 100] give 100")));
}

TEST_F(SafetensorsTest, MalformedEntries) {
  EXPECT_THAT(reading_bad(R"({"w":{"dtype":"F32","shape":[-1],"data_offsets":[0,0]}})"),
              ThrowsMessage<SafetensorsError>(
                  HasSubstr("shape must hold non-negative integers but has -1")));
  EXPECT_THAT(
      reading_bad(R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0]}})"),
      ThrowsMessage<SafetensorsError>(HasSubstr("data_offsets must be [begin, end] but is [0]")));
  EXPECT_THAT(reading_bad(R"({"w":{"dtype":"F32","data_offsets":[0,4]}})", 4),
              ThrowsMessage<SafetensorsError>(HasSubstr("entry has no \"shape\"")));
  EXPECT_THAT(
      reading_bad(R"({"w":{"dtype":"U8","shape":[0],"data_offsets":[4,0]}})", 4),
      ThrowsMessage<SafetensorsError>(HasSubstr("data_offsets [4, 0] end before they begin")));
  EXPECT_THAT(
      reading_bad(R"({"w":{"dtype":"F64","shape":[4294967296,4294967296],"data_offsets":[0,0]}})"),
      ThrowsMessage<SafetensorsError>(HasSubstr("is too large")));
  EXPECT_THAT(reading_bad(R"({"__metadata__":{"step":3}})"),
              ThrowsMessage<SafetensorsError>(
                  HasSubstr("__metadata__ values must be strings but 'step' is 3")));
}

TEST_F(SafetensorsTest, OverlappingOffsets) {
  EXPECT_THAT(reading_bad(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},
                                    "b":{"dtype":"U8","shape":[4],"data_offsets":[2,6]}})",
                          6),
              ThrowsMessage<SafetensorsError>(
                  AllOf(HasSubstr("tensor 'b' in "),
                        HasSubstr("data_offsets [2, 6] overlap those of 'a' [0, 4]"))));
}

TEST_F(SafetensorsTest, GapsAndTrailingBytes) {
  EXPECT_THAT(
      reading_bad(R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},
                                      "b":{"dtype":"U8","shape":[2],"data_offsets":[3,5]}})",
                  5),
      ThrowsMessage<SafetensorsError>(
          AllOf(HasSubstr("tensor 'b' in "), HasSubstr("leave bytes [2, 3) of the data unused"))));

  EXPECT_THAT(reading_bad(R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[1,3]}})", 3),
              ThrowsMessage<SafetensorsError>(HasSubstr("leave bytes [0, 1) of the data unused")));

  EXPECT_THAT(reading_bad(R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}})", 6),
              ThrowsMessage<SafetensorsError>(
                  HasSubstr("data_offsets end at byte 2 but the data section has 6 bytes")));

  EXPECT_THAT(reading_bad(R"({"a":{"dtype":"U8","shape":[8],"data_offsets":[0,8]}})", 6),
              ThrowsMessage<SafetensorsError>(
                  HasSubstr("data_offsets end at byte 8 but the data section has 6 bytes")));
}

TEST_F(SafetensorsTest, NameTwiceInHeader) {
  EXPECT_THAT(reading_bad(R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},
                                    "a":{"dtype":"U8","shape":[2],"data_offsets":[2,4]}})",
                          4),
              ThrowsMessage<SafetensorsError>(HasSubstr("header names 'a' twice")));
}

// ---- bad arguments to write ----------------------------------------------------

TEST_F(SafetensorsTest, WriteRejectsBadNamesAndTensors) {
  auto writing = [&](const Named& tensors) {
    return [this, tensors] { write_safetensors(file("w.safetensors"), tensors); };
  };
  EXPECT_THAT(writing({{"a", at::ones({1})}, {"a", at::ones({2})}}),
              ThrowsMessage<ArgumentError>(
                  HasSubstr("tensor name 'a' is given twice; names must be unique")));
  EXPECT_THAT(writing({{"", at::ones({1})}}),
              ThrowsMessage<ArgumentError>(HasSubstr("tensor names must be non-empty")));
  EXPECT_THAT(writing({{"__metadata__", at::ones({1})}}),
              ThrowsMessage<ArgumentError>(HasSubstr("'__metadata__' is reserved")));
  EXPECT_THAT(writing({{"u", at::Tensor()}}),
              ThrowsMessage<ArgumentError>(HasSubstr("tensor 'u' is undefined")));
  EXPECT_THAT(writing({{"ok", at::ones({1})}, {"c", at::ones({2}, at::kComplexFloat)}}),
              ThrowsMessage<ArgumentError>(AllOf(
                  HasSubstr(file("w.safetensors")),
                  HasSubstr("tensor 'c' has dtype ComplexFloat, which safetensors cannot hold"))));
  EXPECT_THAT(writing({{"bad\xff", at::ones({1})}}),
              ThrowsMessage<ArgumentError>(HasSubstr("must be valid UTF-8")));
  EXPECT_EQ(directory_listing(), std::vector<std::string>{});
}

TEST_F(SafetensorsTest, WriteIntoMissingDirectory) {
  std::string path = file("no/such/dir/x.safetensors");
  EXPECT_THAT([&] { write_safetensors(path, {{"a", at::ones({1})}}); },
              ThrowsMessage<SafetensorsError>(AllOf(HasSubstr(path), HasSubstr("cannot create"))));
}

// ---- atomic replacement ---------------------------------------------------------

TEST_F(SafetensorsTest, FailedWriteLeavesOldFileAndNoTemporary) {
  std::string path = file("model.safetensors");
  write_safetensors(path, {{"w", at::full({4}, 1.5)}}, {{"step", "1"}});
  const std::string before = slurp(path);

  EXPECT_THROW(write_safetensors(path, {{"w", at::full({4}, 2.5)},
                                        {"c", at::ones({1}, at::kComplexDouble)}}),
               ArgumentError);
  EXPECT_EQ(slurp(path), before);
  EXPECT_EQ(directory_listing(), std::vector<std::string>{"model.safetensors"});

  write_safetensors(path, {{"w", at::full({8}, 2.5)}}, {{"step", "2"}});
  SafetensorsFile now = read_safetensors(path);
  EXPECT_TRUE(test::tensors_equal(now.tensors[0].second, at::full({8}, 2.5)));
  EXPECT_EQ(now.metadata.at("step"), "2");
  EXPECT_EQ(directory_listing(), std::vector<std::string>{"model.safetensors"});
}

// The data is fully written when the rename fails (the target is a
// non-empty directory): the temporary must still go.
TEST_F(SafetensorsTest, FailedRenameRemovesTheTemporary) {
  std::string target = file("occupied");
  fs::create_directory(target);
  std::ofstream(target + "/keep") << "x";
  EXPECT_THAT([&] { write_safetensors(target, {{"w", at::ones({1024})}}); },
              ThrowsMessage<SafetensorsError>(HasSubstr("cannot rename")));
  EXPECT_EQ(directory_listing(), std::vector<std::string>{"occupied"});
  EXPECT_TRUE(fs::exists(target + "/keep"));
}

// ---- interoperability with an independent implementation ------------------------

std::string interop_script() { return std::string(HP_SOURCE_DIR) + "/tests/checkpoint/safetensors_interop.py"; }

void run_python(const std::string& command, const std::string& path, const std::string& out) {
  std::string line = cat(HP_PYTHON, " '", interop_script(), "' ", command, " '", path, "' '", out, "'");
  int status = std::system(line.c_str());
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
      << line << " failed (status " << status << "); it needs python3-numpy: scripts/install-deps.sh";
}

std::string dtype_name(at::ScalarType type) {
  switch (type) {
    case at::kDouble: return "F64";
    case at::kFloat: return "F32";
    case at::kHalf: return "F16";
    case at::kBFloat16: return "BF16";
    case at::kLong: return "I64";
    case at::kInt: return "I32";
    case at::kShort: return "I16";
    case at::kChar: return "I8";
    case at::kByte: return "U8";
    case at::kBool: return "BOOL";
    default: return "?";
  }
}

// Compares tensors with the Python side's description of the same file:
// integers exactly, floats as the exact doubles Python's json round-trips
// (bf16 widened to float32 on both sides).
void expect_matches_description(const SafetensorsFile& file, const nlohmann::json& description) {
  std::map<std::string, std::string> metadata = description["metadata"];
  EXPECT_EQ(file.metadata, metadata);
  const auto& described = description["tensors"];
  ASSERT_EQ(file.tensors.size(), described.size());
  for (size_t i = 0; i < described.size(); ++i) {
    const auto& [name, tensor] = file.tensors[i];
    const auto& d = described[i];
    SCOPED_TRACE(name);
    EXPECT_EQ(name, d["name"].get<std::string>());
    EXPECT_EQ(dtype_name(tensor.scalar_type()), d["dtype"].get<std::string>());
    EXPECT_EQ(tensor.sizes().vec(), d["shape"].get<std::vector<int64_t>>());
    const auto& values = d["values"];
    ASSERT_EQ(static_cast<size_t>(tensor.numel()), values.size());
    at::Tensor flat = tensor.reshape({-1});
    if (at::isFloatingType(tensor.scalar_type())) {
      at::Tensor v = flat.to(at::kDouble);
      for (size_t j = 0; j < values.size(); ++j) {
        EXPECT_EQ(v[j].item<double>(), values[j].get<double>()) << "element " << j;
      }
    } else {
      at::Tensor v = flat.to(at::kLong);
      for (size_t j = 0; j < values.size(); ++j) {
        int64_t expected = values[j].is_boolean() ? values[j].get<bool>() : values[j].get<int64_t>();
        EXPECT_EQ(v[j].item<int64_t>(), expected) << "element " << j;
      }
    }
  }
}

nlohmann::json read_json(const std::string& path) { return nlohmann::json::parse(slurp(path)); }

TEST_F(SafetensorsTest, PythonReadsWhatWeWrite) {
  Named tensors = every_dtype();
  // No NaN or infinity: Python's json would write them as non-JSON tokens.
  tensors[1].second = at::tensor({0.0f, -0.0f, 1e-40f, 3.5f, -1e38f});
  tensors[2].second = at::linspace(-60000, 60000, 64).to(at::kHalf).reshape({8, 8});
  tensors[3].second = at::linspace(-1e30, 1e30, 64).to(at::kBFloat16).reshape({4, 16});
  tensors.emplace_back("empty", at::empty({0, 5}));
  tensors.emplace_back("scalar", at::scalar_tensor(3.25, at::kDouble));
  std::map<std::string, std::string> metadata = {{"format", "pt"}, {"written_by", "hp"}};
  write_safetensors(file("cpp.safetensors"), tensors, metadata);

  run_python("describe", file("cpp.safetensors"), file("cpp.json"));
  nlohmann::json description = read_json(file("cpp.json"));
  EXPECT_EQ(description["data_start"].get<int64_t>() % 8, 0);
  SafetensorsFile expected{tensors, metadata};
  expect_matches_description(expected, description);
}

TEST_F(SafetensorsTest, WeReadWhatPythonWrites) {
  run_python("write", file("py.safetensors"), file("py.json"));
  nlohmann::json description = read_json(file("py.json"));
  // Python padded its header its own way, and listed the tensors in reverse.
  EXPECT_EQ(description["data_start"].get<int64_t>() % 64, 0);
  std::string header = slurp(file("py.safetensors")).substr(8, header_length(file("py.safetensors")));
  EXPECT_LT(header.find("\"scalar\""), header.find("\"f64\""));

  SafetensorsFile back = read_safetensors(file("py.safetensors"));
  expect_matches_description(back, description);
  ASSERT_EQ(back.tensors.size(), 12u);
  EXPECT_EQ(back.tensors.front().first, "f64");
  EXPECT_EQ(back.tensors.back().first, "scalar");
  EXPECT_EQ(back.tensors.back().second.dim(), 0);
}

}  // namespace
}  // namespace hp::checkpoint
