// Sharded checkpoints on the ranks of one job (C1, C2, C4, C5): every
// tensor saved in one layout and loaded into another, compared exactly with
// the global tensor every rank builds itself (values are small integers, so
// equality is the only right answer); mismatches and corrupt files raising
// the same error on every rank; a GPT with AdamW saved from FSDP and loaded
// into other modes and into one whole model per rank; resume bit for bit.
// Runs on 1, 2, 3 and 4 ranks (3: uneven shards, empty pieces).
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <fmt/format.h>

#include <filesystem>
#include <fstream>

#include "hp/checkpoint/checkpoint.h"
#include "hp/checkpoint/consolidated.h"
#include "hp/checkpoint/metadata.h"
#include "hp/checkpoint/plan.h"
#include "hp/checkpoint/safetensors.h"
#include "hp/checkpoint/training_state.h"
#include "hp/checkpoint/file_io.h"
#include "hp/fsdp/fully_shard.h"
#include "hp/mesh/device_mesh.h"
#include "hp/tensor/dtensor_tensor.h"
#include "hp/util/error.h"
#include "tests/checkpoint/checkpoint_test_util.h"
#include "tests/fsdp/gpt_fixture.h"
#include "tests/support/tensor_checks.h"

namespace hp::checkpoint {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::ThrowsMessage;
using test::numbered;
using test::SharedTempDir;
using test::tensors_equal;

int world() { return test::world_size(); }

// The meshes a world of W ranks can take: 1-D [W], and 2-D (replicate,
// shard) as [2, W/2] where W is even, else [W, 1]; and [1, W].
struct Meshes {
  DeviceMeshPtr flat, square, wide;
  Meshes() {
    const int64_t w = world();
    flat = init_device_mesh("cpu", {w}, {"shard"});
    square = w % 2 == 0 ? init_device_mesh("cpu", {2, w / 2}, {"replicate", "shard"})
                        : init_device_mesh("cpu", {w, 1}, {"replicate", "shard"});
    wide = init_device_mesh("cpu", {1, w}, {"outer", "inner"});
  }
};

// Every layout that fits a tensor of `ndim` dims; undefined = whole.
std::vector<Layout> layouts_for(const Meshes& m, int64_t ndim) {
  std::vector<Layout> out{Layout()};
  out.emplace_back(m.flat, Placements{Replicate()});
  if (ndim == 0) return out;
  out.emplace_back(m.flat, Placements{Shard(0)});
  out.emplace_back(m.square, Placements{Replicate(), Shard(0)});        // HSDP
  out.emplace_back(m.square, Placements{Shard(0), Shard(0)});           // two mesh dims on dim 0
  out.emplace_back(m.wide, Placements{Shard(-1), Replicate()});
  if (ndim >= 2) {
    out.emplace_back(m.flat, Placements{Shard(1)});
    out.emplace_back(m.square, Placements{Shard(0), Shard(1)});
  }
  return out;
}

struct Key {
  std::string name;
  std::vector<int64_t> shape;
  at::ScalarType dtype;
};

const std::vector<Key> kKeys = {
    {"w.uneven", {7, 5}, at::kFloat},  {"w.even", {8, 6}, at::kFloat},
    {"b.vec", {3}, at::kDouble},        {"s.scalar", {}, at::kLong},
    {"e.empty", {0, 4}, at::kFloat},    {"t.cube", {5, 3, 2}, at::kBFloat16},
    {"m.mask", {6, 2}, at::kBool},
};

// This rank's piece of `global` in `layout`.
at::Tensor piece_of(const at::Tensor& global, const Layout& layout) {
  if (!layout.defined()) return global.clone();
  return distribute_tensor(global, layout).local().clone();
}

void add_piece(State& state, const std::string& key, const at::Tensor& piece,
               const Layout& layout, const std::vector<int64_t>& shape) {
  if (layout.defined()) {
    state.add(key, piece, layout, shape);
  } else {
    state.add(key, piece);
  }
}

TEST(ShardedCheckpoint, RoundTripsBetweenAnyTwoLayouts) {
  SharedTempDir dir("roundtrip");
  Meshes meshes;
  // Round r saves key k in its layout r and loads it into layout r + k + 1,
  // so the rounds pair most layouts with most others.
  for (int round = 0; round < 4; ++round) {
    State saved, loaded;
    std::vector<at::Tensor> globals, targets;
    std::vector<Layout> target_layouts;
    for (size_t k = 0; k < kKeys.size(); ++k) {
      const Key& key = kKeys[k];
      const auto options = layouts_for(meshes, static_cast<int64_t>(key.shape.size()));
      const Layout& from = options[round % options.size()];
      const Layout& to = options[(round + k + 1) % options.size()];
      at::Tensor global = numbered(key.shape, key.dtype, static_cast<int64_t>(k));
      add_piece(saved, key.name, piece_of(global, from), from, key.shape);
      at::Tensor target = at::zeros_like(piece_of(global, to));
      add_piece(loaded, key.name, target, to, key.shape);
      globals.push_back(global);
      targets.push_back(target);
      target_layouts.push_back(to);
    }
    const SaveResult written = save(saved, dir.path(), round);
    const LoadResult read = load(loaded, dir.path());
    EXPECT_EQ(read.path, written.path);
    EXPECT_EQ(read.step, round);
    for (size_t k = 0; k < kKeys.size(); ++k) {
      EXPECT_TRUE(tensors_equal(targets[k], piece_of(globals[k], target_layouts[k])))
          << kKeys[k].name << " round " << round << " into "
          << (target_layouts[k].defined() ? target_layouts[k].str() : "whole");
    }
  }
}

TEST(ShardedCheckpoint, ReplicatedDataIsWrittenOnceByTheLowestRank) {
  SharedTempDir dir("once");
  Meshes meshes;
  State state;
  at::Tensor whole = numbered({6, 4}, at::kFloat, 1);
  state.add("whole", whole.clone());
  const Layout hsdp(meshes.square, {Replicate(), Shard(0)});
  state.add("hsdp", piece_of(whole, hsdp), hsdp, {6, 4});
  const SaveResult result = save(state, dir.path(), 0);
  const std::string path = result.path + "/metadata.json";
  const Metadata m = Metadata::parse(read_whole_file(path), path);
  // parse() checks that each tensor's chunks tile it without overlap, so
  // every element is written exactly once; here: by whom.
  ASSERT_EQ(m.find("whole")->chunks.size(), 1u);
  EXPECT_EQ(m.find("whole")->chunks[0].file, "rank-00000.safetensors");
  const int64_t shards = meshes.square->size(1);
  ASSERT_EQ(static_cast<int64_t>(m.find("hsdp")->chunks.size()), std::min<int64_t>(shards, 6));
  for (const ChunkRecord& c : m.find("hsdp")->chunks) {
    // Replica 0 (mesh row 0) holds ranks 0 .. shards-1: the lowest of each piece.
    EXPECT_LT(std::stoi(c.file.substr(5, 5)), shards) << c.file;
  }
  uint64_t data = 0;
  for (const auto& [name, f] : m.files) data += f.bytes - f.header_bytes;
  EXPECT_EQ(data, 2u * 6 * 4 * sizeof(float));
}

TEST(ShardedCheckpoint, MismatchesRaiseOnEveryRankAndChangeNothing) {
  SharedTempDir dir("mismatch");
  Meshes meshes;
  const Layout fsdp(meshes.flat, {Shard(0)});
  State state;
  state.add("a", piece_of(numbered({5, 3}, at::kFloat, 1), fsdp), fsdp, {5, 3});
  state.add("b", numbered({4}, at::kLong, 2));
  save(state, dir.path(), 3);

  at::Tensor a = at::full(piece_of(numbered({5, 3}, at::kFloat, 1), fsdp).sizes(), -1.0);
  at::Tensor b = at::full({4}, -1, at::kLong);
  auto unchanged = [&] {
    EXPECT_TRUE(a.eq(-1).all().item<bool>());
    EXPECT_TRUE(b.eq(-1).all().item<bool>());
  };
  {
    State missing;
    missing.add("a", a, fsdp, {5, 3});
    missing.add("b", b);
    missing.add("c", at::zeros({2}));
    EXPECT_THAT([&] { load(missing, dir.path()); },
                ThrowsMessage<ArgumentError>(AllOf(HasSubstr("missing key(s) 'c'"),
                                                   HasSubstr("step-00000003"))));
    unchanged();
  }
  {
    State unexpected;
    unexpected.add("a", a, fsdp, {5, 3});
    EXPECT_THAT([&] { load(unexpected, dir.path()); },
                ThrowsMessage<ArgumentError>(HasSubstr("unexpected key(s) 'b'")));
    unchanged();
    // Not strict: keys of the checkpoint the state lacks are skipped.
    at::Tensor a2 = at::zeros_like(a);
    State partial;
    partial.add("a", a2, fsdp, {5, 3});
    load(partial, dir.path(), {/*strict=*/false});
    EXPECT_TRUE(tensors_equal(a2, piece_of(numbered({5, 3}, at::kFloat, 1), fsdp)));
  }
  {
    State shape;
    shape.add("a", a, fsdp, {5, 3});
    shape.add("b", at::full({2, 2}, -1, at::kLong));
    EXPECT_THAT([&] { load(shape, dir.path()); },
                ThrowsMessage<ArgumentError>(
                    AllOf(HasSubstr("key 'b' has shape [4] in the checkpoint but [2, 2]"))));
    unchanged();
  }
  {
    State dtype;
    dtype.add("a", a, fsdp, {5, 3});
    dtype.add("b", at::full({4}, -1, at::kInt));
    EXPECT_THAT([&] { load(dtype, dir.path()); },
                ThrowsMessage<ArgumentError>(HasSubstr("key 'b' has dtype I64 in the checkpoint but I32")));
    unchanged();
  }
  {
    // Only some ranks' pieces are wrong (the last rank's): still every rank raises.
    const bool last = test::rank() == world() - 1;
    at::Tensor bad = last ? at::zeros({a.size(0) + 1, 3}) : a;
    State piece;
    piece.add("a", bad, fsdp, {5, 3});
    piece.add("b", b);
    EXPECT_THAT([&] { load(piece, dir.path()); },
                ThrowsMessage<ArgumentError>(HasSubstr("key 'a' has a local piece of shape")));
    unchanged();
    EXPECT_THAT([&] { save(piece, dir.path(), 4); },
                ThrowsMessage<ArgumentError>(HasSubstr("tensor 'a' has a local piece of shape")));
  }
  if (world() > 1) {
    // A state that differs between ranks (rank 0 has one key more) would
    // make the ranks plan different collectives: refused on every rank.
    State uneven;
    uneven.add("a", a, fsdp, {5, 3});
    uneven.add("b", b);
    if (test::rank() == 0) uneven.add("c", at::zeros({2}));
    EXPECT_THAT([&] { save(uneven, dir.path(), 5); },
                ThrowsMessage<ArgumentError>(HasSubstr("the ranks' states differ")));
    EXPECT_THAT([&] { load(uneven, dir.path()); },
                ThrowsMessage<ArgumentError>(HasSubstr("the ranks' states differ")));
    unchanged();
  }
  EXPECT_THAT([&] { load(state, dir / "nothing-here"); },
              ThrowsMessage<CheckpointError>(HasSubstr("holds no complete checkpoint")));
}

// Applies `edit` to `path` on rank 0 only, then lets every rank go on.
void edit_on_rank0(const std::string& path, const std::function<void(std::fstream&)>& edit) {
  if (test::rank() == 0) {
    std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
    ASSERT_TRUE(f.good()) << path;
    edit(f);
  }
  SharedTempDir::sync();
}

void flip_byte(const std::string& path, uint64_t offset) {
  edit_on_rank0(path, [&](std::fstream& f) {
    f.seekg(static_cast<std::streamoff>(offset));
    char c = 0;
    f.read(&c, 1);
    c = static_cast<char>(c ^ 0x10);
    f.seekp(static_cast<std::streamoff>(offset));
    f.write(&c, 1);
  });
}

TEST(ShardedCheckpoint, CorruptOrTruncatedFilesRaiseNamingTheFile) {
  SharedTempDir dir("corrupt");
  Meshes meshes;
  const Layout fsdp(meshes.flat, {Shard(0)});
  const at::Tensor global = numbered({8, 16}, at::kFloat, 3);
  State state;
  state.add("w", piece_of(global, fsdp), fsdp, {8, 16});
  const std::string path = save(state, dir.path(), 1).path;
  const std::string last_file = path + "/" + fmt::format("rank-{:05d}.safetensors", world() - 1);
  const std::string metadata_path = path + "/metadata.json";
  const Metadata m = Metadata::parse(read_whole_file(metadata_path), metadata_path);
  const ChunkRecord& chunk = m.find("w")->chunks.back();
  ASSERT_EQ(path + "/" + chunk.file, last_file);
  auto load_again = [&] {
    State into;
    into.add("w", at::zeros_like(piece_of(global, fsdp)), fsdp, {8, 16});
    load(into, dir.path());
  };

  flip_byte(last_file, chunk.byte_offset + chunk.bytes / 2);
  EXPECT_THAT(load_again, ThrowsMessage<CheckpointError>(AllOf(
                              HasSubstr(last_file), HasSubstr("key 'w' does not match its checksum"))));
  flip_byte(last_file, chunk.byte_offset + chunk.bytes / 2);  // back as it was
  load_again();

  flip_byte(last_file, 20);  // inside the safetensors header
  EXPECT_THAT(load_again, ThrowsMessage<CheckpointError>(
                              AllOf(HasSubstr(last_file), HasSubstr("header does not match"))));
  flip_byte(last_file, 20);

  flip_byte(metadata_path, 40);
  EXPECT_THAT(load_again, ThrowsMessage<CheckpointError>(HasSubstr(metadata_path)));
  flip_byte(metadata_path, 40);

  if (test::rank() == 0) std::filesystem::resize_file(last_file, chunk.byte_offset + 4);
  SharedTempDir::sync();
  EXPECT_THAT(load_again, ThrowsMessage<CheckpointError>(
                              AllOf(HasSubstr(last_file), HasSubstr("truncated"))));
  if (test::rank() == 0) std::filesystem::remove(last_file);
  SharedTempDir::sync();
  EXPECT_THAT(load_again, ThrowsMessage<CheckpointError>(
                              AllOf(HasSubstr(last_file), HasSubstr("cannot open"))));
}

TEST(ShardedCheckpoint, TheNewestCompleteCheckpointIsLoaded) {
  SharedTempDir dir("newest");
  auto state_of = [](at::Tensor t) {
    State s;
    s.add("x", t);
    return s;
  };
  save(state_of(at::full({3}, 1.0)), dir.path(), 1);
  save(state_of(at::full({3}, 2.0)), dir.path(), 20);
  save(state_of(at::full({3}, 3.0)), dir.path(), 3);
  save(state_of(at::full({3}, 4.0)), dir.path(), 3);  // replaces step 3
  if (test::rank() == 0) {
    // What a crashed save leaves, and a directory that is no checkpoint.
    std::filesystem::create_directories(dir / ".tmp-step-00000099");
    std::ofstream(dir / ".tmp-step-00000099/metadata.json") << "{";
    std::filesystem::create_directories(dir / "step-00000050");
  }
  SharedTempDir::sync();
  EXPECT_EQ(latest_checkpoint(dir.path()), dir / "step-00000020");
  at::Tensor x = at::zeros({3});
  State into = state_of(x);
  EXPECT_EQ(load(into, dir.path()).step, 20);
  EXPECT_TRUE(tensors_equal(x, at::full({3}, 2.0)));
  load(into, dir / "step-00000003");
  EXPECT_TRUE(tensors_equal(x, at::full({3}, 4.0)));
  // The next save of a crashed step replaces the leftover.
  save(state_of(at::full({3}, 5.0)), dir.path(), 99);
  EXPECT_EQ(load(into, dir.path()).step, 99);
  EXPECT_TRUE(tensors_equal(x, at::full({3}, 5.0)));
  EXPECT_FALSE(std::filesystem::exists(dir / ".tmp-step-00000099"));
}

// A save root is one job's: a second job (here: this process's test, holding
// the lock as another job's rank 0 would) is refused on every rank, naming
// the holder, before anything is written; once the holder is gone the save
// goes ahead and the lock file names this process.
TEST(SaveRoots, ASaveIntoARootAnotherJobHoldsIsRefusedNamingTheHolder) {
  SharedTempDir dir("locked");
  State state;
  state.add("x", at::full({3}, 1.0));
  int other = -1;
  if (test::rank() == 0) {
    other = ::open((dir / ".hp-save.lock").c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    ASSERT_GE(other, 0);
    ASSERT_EQ(::flock(other, LOCK_EX | LOCK_NB), 0);
    const std::string holder = "host elsewhere pid 4242 run 00000000deadbeef since then\n";
    ASSERT_EQ(::write(other, holder.data(), holder.size()), static_cast<ssize_t>(holder.size()));
  }
  SharedTempDir::sync();
  EXPECT_THAT([&] { save(state, dir.path(), 7); },
              ThrowsMessage<CheckpointError>(AllOf(
                  HasSubstr("checkpoint root " + dir.path() + " is in use by another job"),
                  HasSubstr("host elsewhere pid 4242 run 00000000deadbeef"))));
  EXPECT_FALSE(std::filesystem::exists(dir / ".tmp-step-00000007"));
  EXPECT_EQ(latest_checkpoint(dir.path()), std::nullopt);
  SharedTempDir::sync();
  if (test::rank() == 0) ::close(other);  // the other job ends
  SharedTempDir::sync();
  EXPECT_EQ(save(state, dir.path(), 7).path, dir / "step-00000007");
  if (test::rank() == 0) {
    EXPECT_THAT(read_whole_file(dir / ".hp-save.lock"),
                HasSubstr(fmt::format("pid {} run ", ::getpid())));
  }
}

// A failed save removes its temporary directory on every path: a rank's
// file that cannot be written, a commit that fails.
TEST(SaveRoots, AFailedSaveRemovesItsTemporaryDirectory) {
  SharedTempDir dir("failed");
  State state;
  state.add("x", at::full({3}, 1.0));
  const int last = world() - 1;
  SaveOptions disk_full;
  disk_full.before_rank_file = [last] {
    if (test::rank() == last) throw std::runtime_error("disk full on the last rank");
  };
  EXPECT_THAT([&] { save(state, dir.path(), 4, disk_full); },
              ThrowsMessage<CheckpointError>(HasSubstr("disk full on the last rank")));
  SharedTempDir::sync();
  EXPECT_FALSE(std::filesystem::exists(dir / ".tmp-step-00000004"));
  SaveOptions no_commit;
  no_commit.before_commit = [] { throw std::runtime_error("the commit failed"); };
  EXPECT_THAT([&] { save(state, dir.path(), 5, no_commit); },
              ThrowsMessage<CheckpointError>(HasSubstr("the commit failed")));
  SharedTempDir::sync();
  EXPECT_FALSE(std::filesystem::exists(dir / ".tmp-step-00000005"));
  EXPECT_EQ(latest_checkpoint(dir.path()), std::nullopt);
}

// A replace that stopped between its two renames leaves .old-step-N and no
// step-N: a load reads it there, and the next save renames it back (and
// removes a .old-step-N whose step-N exists). A replace swaps the contents.
TEST(SaveRoots, AReplaceStoppedBetweenItsRenamesIsRecovered) {
  SharedTempDir dir("old");
  auto state_of = [](at::Tensor t) {
    State s;
    s.add("x", t);
    return s;
  };
  save(state_of(at::full({3}, 2.0)), dir.path(), 2);
  save(state_of(at::full({3}, 9.0)), dir.path(), 3);
  save(state_of(at::full({3}, 3.0)), dir.path(), 3);  // replaces step 3
  if (test::rank() == 0) {
    std::filesystem::rename(dir / "step-00000003", dir / ".old-step-00000003");
    std::filesystem::copy(dir / "step-00000002", dir / ".old-step-00000002",
                          std::filesystem::copy_options::recursive);
  }
  SharedTempDir::sync();
  at::Tensor x = at::zeros({3});
  State into = state_of(x);
  EXPECT_EQ(load(into, dir.path()).step, 3);
  EXPECT_TRUE(tensors_equal(x, at::full({3}, 3.0)));
  save(state_of(at::full({3}, 5.0)), dir.path(), 5);
  SharedTempDir::sync();
  EXPECT_TRUE(std::filesystem::exists(dir / "step-00000003/metadata.json"));
  EXPECT_FALSE(std::filesystem::exists(dir / ".old-step-00000003"));
  EXPECT_FALSE(std::filesystem::exists(dir / ".old-step-00000002"));
  load(into, dir / "step-00000003");
  EXPECT_TRUE(tensors_equal(x, at::full({3}, 3.0)));
}

// A newest checkpoint that fails its checks (here: corrupt metadata, and
// below it a chunk that fails its checksum) is skipped, saying so, and the
// newest one that passes them is loaded.
TEST(SaveRoots, ACorruptNewestCheckpointFallsBackToThePreviousOne) {
  SharedTempDir dir("fallback");
  auto state_of = [](at::Tensor t) {
    State s;
    s.add("x", t);
    return s;
  };
  for (int64_t step = 1; step <= 3; ++step) {
    save(state_of(at::full({64}, static_cast<double>(step))), dir.path(), step);
  }
  flip_byte(dir / "step-00000003/metadata.json", 40);
  const std::string two = dir / "step-00000002";
  const Metadata m = Metadata::parse(read_whole_file(two + "/metadata.json"), two);
  const ChunkRecord& chunk = m.find("x")->chunks.front();
  flip_byte(two + "/" + chunk.file, chunk.byte_offset + chunk.bytes / 2);
  at::Tensor x = at::zeros({64});
  State into = state_of(x);
  testing::internal::CaptureStderr();
  const LoadResult r = load(into, dir.path());
  const std::string err = testing::internal::GetCapturedStderr();
  EXPECT_EQ(r.step, 1);
  EXPECT_TRUE(tensors_equal(x, at::full({64}, 1.0)));
  ASSERT_EQ(r.skipped.size(), 2u);
  EXPECT_THAT(r.skipped[0], HasSubstr(dir / "step-00000003/metadata.json"));
  EXPECT_THAT(r.skipped[1], HasSubstr("does not match its checksum"));
  if (test::rank() == 0) {
    EXPECT_THAT(err, HasSubstr("skipping " + dir / "step-00000003" + ", which fails its checks"));
    EXPECT_THAT(err, HasSubstr("falling back to " + dir / "step-00000001"));
  }
  // Nothing intact: every failure is listed.
  flip_byte(dir / "step-00000001/metadata.json", 40);
  EXPECT_THAT([&] { load(into, dir.path()); },
              ThrowsMessage<CheckpointError>(AllOf(HasSubstr("holds no intact checkpoint"),
                                                   HasSubstr(dir / "step-00000001"),
                                                   HasSubstr(dir / "step-00000003"))));
}

// Each rank resolves a root itself: ranks that see different newest
// checkpoints (here: a different root per rank, as a network file system
// showing ranks different directories would) refuse on every rank, naming
// both steps, instead of resuming from two steps.
TEST(SaveRoots, RanksThatChooseDifferentCheckpointsRefuseNamingBoth) {
  if (world() < 2) GTEST_SKIP() << "needs two ranks";
  SharedTempDir dir("disagree");
  auto state_of = [](at::Tensor t) {
    State s;
    s.add("x", t);
    return s;
  };
  save(state_of(at::full({3}, 2.0)), dir / "a", 2);
  save(state_of(at::full({3}, 3.0)), dir / "b", 3);
  at::Tensor x = at::zeros({3});
  State into = state_of(x);
  EXPECT_THAT([&] { load(into, test::rank() == 0 ? dir / "a" : dir / "b"); },
              ThrowsMessage<CheckpointError>(AllOf(HasSubstr("differs between the ranks"),
                                                   HasSubstr("rank 0 has step 2"),
                                                   HasSubstr("has step 3"))));
  EXPECT_TRUE(tensors_equal(x, at::zeros({3})));
}

// Tensor-parallel parameters are tensor-form DTensors (dtensor_tensor.h):
// a state takes them as their shards and layouts, and load writes the shards.
TEST(ShardedCheckpoint, TensorFormDTensorsAreTheirShards) {
  SharedTempDir dir("tensorform");
  Meshes meshes;
  const Layout tp(meshes.flat, {Shard(0)});
  const at::Tensor global = numbered({6, 4}, at::kFloat, 5);
  const at::Tensor param = distribute(global, tp);
  State state;
  state.add("w", param);
  save(state, dir.path(), 0);
  const at::Tensor target = distribute(at::zeros({6, 4}), tp);
  State into;
  into.add("w", target);
  load(into, dir.path());
  EXPECT_TRUE(tensors_equal(local_of(target), local_of(param)));
  at::Tensor whole = at::zeros({6, 4});
  State one;
  one.add("w", whole);
  load(one, dir.path());
  EXPECT_TRUE(tensors_equal(whole, global));
  // A raw StridedShard piece is several boxes, which the format does not hold.
  EXPECT_THAT(
      [&] {
        State strided;
        strided.add("q", at::zeros({2, 4}), Layout(meshes.flat, {StridedShard(0, 3)}), {6, 4});
      },
      ThrowsMessage<ArgumentError>(HasSubstr("StridedShard")));
  // The tensor form of one (a fused QKV weight) is saved as its plain shard
  // and loaded back into the strided piece, or into any other layout.
  const Layout qkv(meshes.flat, {StridedShard(0, 3)});  // 3 blocks of 12 rows: any of 1-4 ranks
  const at::Tensor fused = numbered({36, 4}, at::kFloat, 9);
  const at::Tensor strided = distribute(fused, qkv);
  State with_strided;
  with_strided.add("qkv", strided);
  save(with_strided, dir.path(), 1);
  const at::Tensor strided_target = distribute(at::zeros({36, 4}), qkv);
  State strided_into;
  strided_into.add("qkv", strided_target);
  load(strided_into, dir.path());
  EXPECT_TRUE(tensors_equal(local_of(strided_target), local_of(strided)));
  at::Tensor fused_whole = at::zeros({36, 4});
  State whole_into;
  whole_into.add("qkv", fused_whole);
  load(whole_into, dir.path());
  EXPECT_TRUE(tensors_equal(fused_whole, fused));
}

// ---- a GPT with AdamW ------------------------------------------------------

// FSDP over every rank, HSDP (2, W/2) or DDP (W, 1), or nothing (each rank
// holds the whole model, as one process does).
enum class Mode { kFsdp, kHsdp, kNone };

struct Trained {
  nn::GPT model;
  std::optional<FSDPModule> root;
  std::unique_ptr<torch::optim::AdamW> optimizer;
};

Trained make_trained(Mode mode, uint64_t seed) {
  Trained t{test::make_gpt(seed), std::nullopt, nullptr};
  if (mode != Mode::kNone && dist::is_initialized()) {
    FullyShardOptions options;
    const int64_t w = world();
    options.mesh = mode == Mode::kFsdp
                       ? init_device_mesh("cpu", {w}, {"shard"})
                       : init_device_mesh("cpu", {w % 2 == 0 ? 2 : w, w % 2 == 0 ? w / 2 : 1},
                                          {"replicate", "shard"});
    for (const nn::Block& block : t.model->blocks()) fully_shard(block.ptr(), options);
    t.root = fully_shard(t.model.ptr(), options);
  }
  t.optimizer = std::make_unique<torch::optim::AdamW>(
      t.model->parameters(), torch::optim::AdamWOptions(1e-2).betas({0.9, 0.95}).weight_decay(0.1));
  return t;
}

// One step on the global batch of `step`, this rank's rows when sharded
// (every rank's rows when not); returns the global mean loss.
double train_step(Trained& t, int step) {
  const at::Tensor tokens = test::token_batch(step);
  const bool sharded = t.root.has_value();
  at::Tensor loss = sharded ? test::gpt_loss(t.model, tokens, test::my_first_row(), test::my_rows())
                            : test::gpt_loss(t.model, tokens, 0, test::kBatch);
  loss.backward();
  t.optimizer->step();
  if (sharded) {
    t.root->zero_grad();
  } else {
    t.model->zero_grad(true);
  }
  return sharded ? test::world_mean(loss.item<double>()) : loss.item<double>();
}

State training_state(Trained& t, int64_t& step) {
  State s;
  add_model(s, *t.model);
  add_adamw(s, *t.optimizer, *t.model);
  add_int(s, "train.step", step);
  return s;
}

// Whole parameters and AdamW moments by name (collective when sharded).
std::map<std::string, at::Tensor> whole_state(Trained& t) {
  int64_t step = 0;
  State s = training_state(t, step);
  std::map<std::string, at::Tensor> out;
  for (const StateEntry& e : s.entries()) {
    out[e.key] = e.layout.defined()
                     ? from_local(e.local.detach(), e.layout, {e.shape}).full_tensor()
                     : e.local.detach().clone();
  }
  return out;
}

void expect_same_state(const std::map<std::string, at::Tensor>& actual,
                       const std::map<std::string, at::Tensor>& expected, const char* what) {
  ASSERT_EQ(actual.size(), expected.size()) << what;
  for (const auto& [key, value] : expected) {
    EXPECT_TRUE(tensors_equal(actual.at(key), value)) << what << ": " << key;
  }
}

TEST(ShardedCheckpoint, GPTWithAdamWMovesBetweenModesExactly) {
  SharedTempDir dir("gpt");
  Trained source = make_trained(Mode::kFsdp, 7);
  for (int s = 0; s < 2; ++s) train_step(source, s);
  int64_t step = 2;
  save(training_state(source, step), dir.path(), step);
  const auto expected = whole_state(source);
  EXPECT_EQ(expected.count("optim.h.0.attn.c_attn.weight.exp_avg"), 1u);

  for (Mode mode : {Mode::kHsdp, Mode::kNone, Mode::kFsdp}) {
    Trained target = make_trained(mode, 99);  // other weights, no AdamW state yet
    int64_t loaded_step = -1;
    State into = training_state(target, loaded_step);
    load(into, dir.path());
    EXPECT_EQ(loaded_step, 2);
    expect_same_state(whole_state(target), expected,
                      mode == Mode::kHsdp ? "hsdp" : mode == Mode::kNone ? "whole" : "fsdp");
  }
}

TEST(ShardedCheckpoint, ResumedTrainingEqualsUninterruptedBitForBit) {
  SharedTempDir dir("resume");
  // Uninterrupted: 4 steps.
  Trained straight = make_trained(Mode::kFsdp, 7);
  std::vector<double> straight_losses;
  for (int s = 0; s < 4; ++s) straight_losses.push_back(train_step(straight, s));
  // Interrupted: 2 steps, save, a fresh model and optimizer load, 2 more.
  {
    Trained first = make_trained(Mode::kFsdp, 7);
    for (int s = 0; s < 2; ++s) EXPECT_EQ(train_step(first, s), straight_losses[s]);
    int64_t step = 2;
    save(training_state(first, step), dir.path(), step);
  }
  Trained resumed = make_trained(Mode::kFsdp, 1234);
  int64_t step = 0;
  State into = training_state(resumed, step);
  load(into, dir.path());
  ASSERT_EQ(step, 2);
  for (int s = 2; s < 4; ++s) EXPECT_EQ(train_step(resumed, s), straight_losses[s]) << "step " << s;
  expect_same_state(whole_state(resumed), whole_state(straight), "after 4 steps");
}

TEST(ShardedCheckpoint, ConsolidatedExportImportsIntoAnyMode) {
  SharedTempDir dir("export");
  Trained source = make_trained(Mode::kFsdp, 7);
  train_step(source, 0);
  State weights;
  add_model(weights, *source.model);
  const std::string file = dir / "weights.safetensors";
  EXPECT_GT(export_consolidated(weights, file, "model."), 0u);
  const auto expected = test::full_parameters(*source.model);
  // Every name is GPT-2's, every tensor whole.
  const SafetensorsFile exported = read_safetensors(file);
  ASSERT_EQ(exported.tensors.size(), expected.size());
  for (const auto& [name, value] : exported.tensors) {
    EXPECT_TRUE(tensors_equal(value, expected.at(name))) << name;
  }
  for (Mode mode : {Mode::kHsdp, Mode::kNone}) {
    Trained target = make_trained(mode, 99);
    State into;
    add_model(into, *target.model);
    import_consolidated(into, file, "model.");
    const auto got = test::full_parameters(*target.model);
    for (const auto& [name, value] : expected) EXPECT_TRUE(tensors_equal(got.at(name), value)) << name;
  }
}

}  // namespace
}  // namespace hp::checkpoint
