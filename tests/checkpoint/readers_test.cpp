// Hostile checkpoint files (C8 in docs/features.md): every reader refuses,
// with the named error type and a message naming the file and the limit,
// before it allocates on a file's word or walks past the end of the stack:
// deep JSON, sizes past the limits, arithmetic that would overflow, links,
// FIFOs and step numbers beyond int64.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <fcntl.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>

#include "hp/checkpoint/checkpoint.h"
#include "hp/checkpoint/consolidated.h"
#include "hp/checkpoint/crc32c.h"
#include "hp/checkpoint/errors.h"
#include "hp/checkpoint/file_io.h"
#include "hp/checkpoint/metadata.h"
#include "hp/checkpoint/read_limits.h"
#include "hp/checkpoint/safetensors.h"
#include "hp/checkpoint/state.h"
#include "tests/checkpoint/hostile_inputs.h"
#include "tests/support/tensor_checks.h"

namespace hp::checkpoint {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::ThrowsMessage;
namespace fs = std::filesystem;
using Json = nlohmann::ordered_json;

// A call that blocks forever (open() of a FIFO without a writer) ends the
// test binary by SIGALRM instead of hanging it: a guard, not a timing check.
class HangGuard {
 public:
  HangGuard() { ::alarm(60); }
  ~HangGuard() { ::alarm(0); }
};

class HostileFiles : public testing::Test {
 protected:
  void SetUp() override {
    char pattern[] = "/tmp/hp_hostile_XXXXXX";
    ASSERT_NE(::mkdtemp(pattern), nullptr);
    dir_ = pattern;
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string file(const std::string& name) const { return dir_ + "/" + name; }
  std::string put(const std::string& name, const std::string& bytes) const {
    std::ofstream(file(name), std::ios::binary) << bytes;
    return file(name);
  }
  // A checkpoint of one float tensor "w" = [0, 1, 2, 3] under ROOT/step-1.
  std::string save_small(const std::string& root) const {
    State state;
    state.add("w", at::arange(4, at::kFloat));
    return save(state, root, 1).path;
  }
  static State zeros_state() {
    State state;
    state.add("w", at::zeros({4}, at::kFloat));
    return state;
  }

  std::string dir_;
};

// ---- safetensors -----------------------------------------------------------

TEST_F(HostileFiles, DeepSafetensorsHeaderIsRefusedBeforeParsing) {
  // Just past the limit: refused by depth, not by what the parser makes of it.
  const std::string shallow =
      put("65.safetensors",
          test::safetensors_bytes(R"({"__metadata__":)" + test::nested(kMaxJsonDepth) + "}"));
  EXPECT_THAT([&] { read_safetensors_index(shallow); },
              ThrowsMessage<SafetensorsError>(
                  AllOf(HasSubstr(shallow), HasSubstr("deeper than 64 levels"))));
  // A million levels: nlohmann's dump() of it (an error message quoting the
  // value) would overflow the stack.
  const std::string deep = put(
      "deep.safetensors",
      test::safetensors_bytes(R"({"w":{"dtype":"F32","shape":)" + test::nested(1000000) +
                              R"(,"data_offsets":[0,0]}})"));
  EXPECT_THAT([&] { read_safetensors(deep); },
              ThrowsMessage<SafetensorsError>(HasSubstr("deeper than 64 levels")));
}

TEST_F(HostileFiles, SafetensorsHeaderPastTheLimitIsRefusedBeforeItIsRead) {
  // A sparse file long enough to hold the header it announces: the length
  // alone decides.
  const std::string path = file("long.safetensors");
  const uint64_t length = kMaxSafetensorsHeaderBytes + 1;
  {
    std::ofstream out(path, std::ios::binary);
    out.write(reinterpret_cast<const char*>(&length), 8);
  }
  fs::resize_file(path, 8 + length);
  EXPECT_THAT([&] { read_safetensors_index(path); },
              ThrowsMessage<SafetensorsError>(AllOf(
                  HasSubstr(path), HasSubstr("header length 100000001 is larger than the "
                                             "100000000 bytes a safetensors header may have"))));
}

TEST_F(HostileFiles, EmptyShapeWhoseStridesOverflowIsRefused) {
  // No bytes, but torch would compute strides of 2^64 elements.
  const std::string path = put(
      "zero.safetensors",
      test::safetensors_bytes(
          R"({"w":{"dtype":"F32","shape":[0,4294967296,4294967296],"data_offsets":[0,0]}})"));
  EXPECT_THAT([&] { read_safetensors_index(path); },
              ThrowsMessage<SafetensorsError>(
                  AllOf(HasSubstr(path), HasSubstr("'w'"), HasSubstr("pass INT64_MAX bytes"))));
}

TEST_F(HostileFiles, ShapeOfMoreDimsThanTheLimitIsRefused) {
  std::string ones = "1";
  for (size_t d = 1; d <= kMaxTensorDims; ++d) ones += ",1";  // 65 dims
  const std::string path =
      put("dims.safetensors",
          test::safetensors_bytes(R"({"w":{"dtype":"U8","shape":[)" + ones +
                                      R"(],"data_offsets":[0,1]}})",
                                  "x"));
  EXPECT_THAT([&] { read_safetensors(path); },
              ThrowsMessage<SafetensorsError>(AllOf(
                  HasSubstr(path), HasSubstr("shape has 65 dims, more than the 64"))));
  Json body = test::small_metadata();
  body["tensors"]["w"]["shape"] = Json::parse("[" + ones + "]");
  EXPECT_THAT([&] { Metadata::parse(test::with_checksum(body), "m.json"); },
              ThrowsMessage<CheckpointError>(HasSubstr("shape has 65 dims, more than the 64")));
}

TEST_F(HostileFiles, SafetensorsFifoIsRefusedWithoutBlocking) {
  const std::string path = file("fifo.safetensors");
  ASSERT_EQ(::mkfifo(path.c_str(), 0600), 0);
  HangGuard guard;  // no writer: a blocking open() would never return
  EXPECT_THAT([&] { read_safetensors(path); },
              ThrowsMessage<SafetensorsError>(AllOf(HasSubstr(path), HasSubstr("a FIFO"))));
  EXPECT_THAT([&] { read_safetensors_index(path); },
              ThrowsMessage<SafetensorsError>(HasSubstr("not a regular file")));
}

TEST_F(HostileFiles, SafetensorsFileNamedThroughALinkIsRead) {
  // Model caches are made of links: a file the caller names may be one.
  write_safetensors(file("real.safetensors"), {{"w", at::ones({2})}});
  fs::create_symlink(file("real.safetensors"), file("link.safetensors"));
  EXPECT_EQ(read_safetensors(file("link.safetensors")).tensors.size(), 1u);
}

TEST_F(HostileFiles, ConsolidatedFileNamedThroughALinkIsImported) {
  // The load behind the import opens files without following links: it
  // must be given the file the link leads to.
  write_safetensors(file("real.safetensors"), {{"w", at::arange(4, at::kFloat)}});
  fs::create_symlink(file("real.safetensors"), file("link.safetensors"));
  State state = zeros_state();
  import_consolidated(state, file("link.safetensors"));
  EXPECT_TRUE(test::tensors_equal(state.find("w")->local, at::arange(4, at::kFloat)));
}

// ---- metadata.json ---------------------------------------------------------

TEST_F(HostileFiles, ChunkAtInt64MaxCannotCoverATensor) {
  // [2] covered by [0, 1) and a chunk at INT64_MAX: offset + size overflowed
  // past the shape check, and the chunk counted as covering element 1.
  Json body = test::small_metadata();
  Json chunk = body["tensors"]["w"]["chunks"][0];
  body["tensors"]["w"]["shape"] = {2};
  body["tensors"]["w"]["chunks"][0]["sizes"] = {1};
  body["tensors"]["w"]["chunks"][0]["bytes"] = 4;
  chunk["offsets"] = {INT64_MAX};
  chunk["sizes"] = {1};
  chunk["bytes"] = 4;
  body["tensors"]["w"]["chunks"].push_back(chunk);
  EXPECT_THAT([&] { Metadata::parse(test::with_checksum(body), "m.json"); },
              ThrowsMessage<CheckpointError>(AllOf(
                  HasSubstr("m.json"), HasSubstr("chunk at [9223372036854775807] of sizes [1] "
                                                 "lies outside shape [2]"))));
}

TEST_F(HostileFiles, ChunkAtInt64MaxDoesNotLoadHalfATensor) {
  // The same file on disk: load() refused it before, rather than filling
  // element 0 and leaving the rest as it was.
  const std::string dir = save_small(file("root"));
  const std::string path = dir + "/metadata.json";
  Json body = Json::parse(read_whole_file(path));
  body.erase("crc32c");
  Json& chunks = body["tensors"]["w"]["chunks"];
  ASSERT_EQ(chunks.size(), 1u);
  Json high = chunks[0];
  chunks[0]["sizes"] = {2};
  chunks[0]["bytes"] = 8;
  high["offsets"] = {INT64_MAX - 1};
  high["sizes"] = {2};
  high["bytes"] = 8;
  chunks.push_back(high);
  fs::remove(path);
  put("root/step-00000001/metadata.json", test::with_checksum(body));
  State state = zeros_state();
  EXPECT_THAT([&] { load(state, dir); },
              ThrowsMessage<CheckpointError>(AllOf(HasSubstr(path), HasSubstr("lies outside"))));
}

TEST_F(HostileFiles, MetadataFieldsOutOfRangeAreRefused) {
  auto refused = [](Json body, const std::string& what) {
    EXPECT_THAT([&] { Metadata::parse(test::with_checksum(body), "m.json"); },
                ThrowsMessage<CheckpointError>(AllOf(HasSubstr("m.json"), HasSubstr(what))))
        << what;
  };
  Json body = test::small_metadata();
  body["step"] = -3;
  refused(body, "\"step\" -3 is negative");
  body = test::small_metadata();
  body["step"] = UINT64_MAX;  // would wrap to -1
  refused(body, "must be a 64-bit integer");
  body = test::small_metadata();
  body["world_size"] = 0;
  refused(body, "\"world_size\" 0 must be >= 1");
  body = test::small_metadata();
  body["files"]["rank-00000.safetensors"]["header_bytes"] = 8 + kMaxSafetensorsHeaderBytes + 1;
  body["files"]["rank-00000.safetensors"]["bytes"] = 8 + kMaxSafetensorsHeaderBytes + 100;
  refused(body, "header_bytes 100000009 pass the 100000008");
  body = test::small_metadata();
  body["files"][std::string("rank-00000.safetensors\0x", 24)] =
      body["files"]["rank-00000.safetensors"];
  refused(body, "a file name must be a plain name");
  body = test::small_metadata();
  body["tensors"]["w"]["chunks"][0]["byte_offset"] = UINT64_MAX - 4;
  refused(body, "lie outside the data");
  body = test::small_metadata();
  body["tensors"]["w"]["shape"] = {0, uint64_t{1} << 32, uint64_t{1} << 32};
  body["tensors"]["w"]["chunks"] = Json::array();
  refused(body, "pass INT64_MAX bytes");
}

TEST_F(HostileFiles, DeepMetadataIsRefusedBeforeParsing) {
  const std::string at_limit =
      R"({"crc32c":0,"x":)" + test::nested(kMaxJsonDepth) + "}";
  EXPECT_THAT([&] { Metadata::parse(at_limit, "m.json"); },
              ThrowsMessage<CheckpointError>(
                  AllOf(HasSubstr("m.json"), HasSubstr("deeper than 64 levels"))));
  // The checksum dumps the tree: a million levels overflowed the stack.
  const std::string deep = R"({"crc32c":0,"x":)" + test::nested(1000000) + "}";
  EXPECT_THAT([&] { Metadata::parse(deep, "m.json"); },
              ThrowsMessage<CheckpointError>(HasSubstr("deeper than 64 levels")));
}

TEST_F(HostileFiles, MetadataPastTheLimitIsRefusedBeforeItIsRead) {
  const std::string root = file("root");
  const std::string dir = save_small(root);
  const std::string path = dir + "/metadata.json";
  fs::resize_file(path, kMaxMetadataBytes + 1);  // sparse: nothing is written
  EXPECT_THAT([&] { read_whole_file(path); },
              ThrowsMessage<SafetensorsError>(AllOf(
                  HasSubstr(path), HasSubstr("has 1073741825 bytes, more than the 1073741824"))));
  State state = zeros_state();
  EXPECT_THAT([&] { load(state, root); },
              ThrowsMessage<CheckpointError>(AllOf(HasSubstr(path), HasSubstr("1073741824"))));
}

TEST_F(HostileFiles, OverlapsAreFoundOnGridsAndIrregularLayouts) {
  // A 64 x 64 grid of 1 x 1 chunks (checked by cells), one chunk moved onto
  // its neighbour; then an irregular layout (checked pairwise).
  Json body = test::small_metadata();
  Json& t = body["tensors"]["w"];
  t["shape"] = {64, 64};
  body["files"]["rank-00000.safetensors"]["bytes"] = 8 + 64 + 64 * 64 * 4;
  Json chunks = Json::array();
  for (int i = 0; i < 64; ++i) {
    for (int j = 0; j < 64; ++j) {
      chunks.push_back({{"offsets", {i, j}}, {"sizes", {1, 1}}, {"file", "rank-00000.safetensors"},
                        {"byte_offset", 72 + 4 * (64 * i + j)}, {"bytes", 4}});
    }
  }
  t["chunks"] = chunks;
  EXPECT_NO_THROW(Metadata::parse(test::with_checksum(body), "m.json"));
  t["chunks"][100]["offsets"] = {1, 37};  // where chunk 101 lies
  EXPECT_THAT([&] { Metadata::parse(test::with_checksum(body), "m.json"); },
              ThrowsMessage<CheckpointError>(HasSubstr("chunks at [1, 37] and [1, 37] overlap")));

  // Each row cut in two at its own column: the edges make a grid of rows x
  // (rows + 1) cells, beyond four per chunk, so pairs are compared.
  auto split_rows = [&](int64_t rows) {
    t["shape"] = {rows, rows + 2};
    Json out = Json::array();
    for (int64_t i = 0; i < rows; ++i) {
      for (auto [col, width] : {std::pair<int64_t, int64_t>{0, i + 1}, {i + 1, rows + 1 - i}}) {
        out.push_back({{"offsets", {i, col}}, {"sizes", {1, width}},
                       {"file", "rank-00000.safetensors"}, {"byte_offset", 72},
                       {"bytes", 4 * width}});
      }
    }
    return out;
  };
  t["chunks"] = split_rows(10);
  EXPECT_NO_THROW(Metadata::parse(test::with_checksum(body), "m.json"));
  t["chunks"][19] = {{"offsets", {9, 9}}, {"sizes", {1, 3}}, {"file", "rank-00000.safetensors"},
                     {"byte_offset", 72}, {"bytes", 12}};
  EXPECT_THAT([&] { Metadata::parse(test::with_checksum(body), "m.json"); },
              ThrowsMessage<CheckpointError>(HasSubstr("chunks at [9, 9] and [9, 0] overlap")));

  // Beyond 4096 such chunks neither check fits its budget: refused, named.
  t["chunks"] = split_rows(2049);
  EXPECT_THAT([&] { Metadata::parse(test::with_checksum(body), "m.json"); },
              ThrowsMessage<CheckpointError>(
                  AllOf(HasSubstr("4098 chunks that do not form a grid"),
                        HasSubstr("at most 4096 chunks"))));
}

// ---- checkpoint directories ------------------------------------------------

TEST_F(HostileFiles, StepBeyondInt64IsRefusedNamingTheDirectory) {
  const std::string root = file("root");
  save_small(root);
  const std::string odd = root + "/step-99999999999999999999";
  fs::create_directories(odd);
  put("root/step-99999999999999999999/metadata.json", "{}");
  EXPECT_THAT([&] { latest_checkpoint(root); },
              ThrowsMessage<CheckpointError>(AllOf(
                  HasSubstr(odd), HasSubstr("beyond the largest step a save writes, "
                                            "9223372036854775807"))));
}

TEST_F(HostileFiles, LinkedStepDirectoryIsNotACheckpointOfTheRoot) {
  const std::string root = file("root");
  const std::string real = save_small(root);
  save_small(file("elsewhere"));
  fs::create_directory_symlink(file("elsewhere/step-00000001"), root + "/step-00000009");
  EXPECT_EQ(latest_checkpoint(root), real);
}

TEST_F(HostileFiles, LinksAndFifosInACheckpointAreRefusedNamingThem) {
  const std::string root = file("root");
  const std::string dir = save_small(root);
  const std::string rank_file = dir + "/rank-00000.safetensors";
  fs::rename(rank_file, file("outside.safetensors"));
  fs::create_symlink(file("outside.safetensors"), rank_file);
  State state = zeros_state();
  EXPECT_THAT([&] { load(state, dir); },
              ThrowsMessage<CheckpointError>(
                  AllOf(HasSubstr(rank_file), HasSubstr("is a symbolic link"))));
  EXPECT_TRUE(test::tensors_equal(state.find("w")->local, at::zeros({4})));

  const std::string metadata = dir + "/metadata.json";
  fs::rename(metadata, file("outside.json"));
  fs::create_symlink(file("outside.json"), metadata);
  EXPECT_THAT([&] { load(state, dir); },
              ThrowsMessage<CheckpointError>(
                  AllOf(HasSubstr(metadata), HasSubstr("is a symbolic link"))));

  fs::remove(metadata);
  ASSERT_EQ(::mkfifo(metadata.c_str(), 0600), 0);
  HangGuard guard;  // no writer: a blocking open() would never return
  EXPECT_THAT([&] { load(state, root); },
              ThrowsMessage<CheckpointError>(AllOf(HasSubstr(metadata), HasSubstr("a FIFO"))));
}

}  // namespace
}  // namespace hp::checkpoint
