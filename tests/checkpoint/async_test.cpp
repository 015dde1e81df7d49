// Asynchronous checkpoints (C7): AsyncCheckpointer writes what save()
// writes, from a snapshot taken before save() returns. The live tensors are
// changed while the background write is held back (a test hook), so a
// snapshot that aliased them would put the changed values in the
// checkpoint. Failures of the background write reach every rank through
// the next call. Runs on 1, 2 and 3 ranks (3: uneven shards, empty pieces).
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <chrono>
#include <filesystem>
#include <atomic>
#include <future>
#include <memory>

#include "hp/checkpoint/async_save.h"
#include "hp/checkpoint/checkpoint.h"
#include "hp/checkpoint/file_io.h"
#include "hp/checkpoint/training_state.h"
#include "hp/mesh/device_mesh.h"
#include "hp/util/error.h"
#include "hp/util/memory_stats.h"
#include "tests/checkpoint/checkpoint_test_util.h"
#include "tests/support/tensor_checks.h"

namespace hp::checkpoint {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::ThrowsMessage;
using test::numbered;
using test::SharedTempDir;
using test::tensors_equal;

// Global tensors in several layouts, with their live pieces: Shard (uneven
// on 3 ranks), HSDP-like Replicate x Shard on a [1, W] mesh, Replicate, and
// whole on every rank.
struct Pieces {
  std::vector<std::string> keys = {"w.shard", "w.inner", "b.replicate", "s.whole"};
  std::vector<at::Tensor> globals;
  std::vector<Layout> layouts;
  std::vector<at::Tensor> live;

  explicit Pieces(int64_t salt) {
    const int64_t w = test::world_size();
    DeviceMeshPtr flat = init_device_mesh("cpu", {w}, {"shard"});
    DeviceMeshPtr wide = init_device_mesh("cpu", {1, w}, {"outer", "inner"});
    globals = {numbered({7, 5}, at::kFloat, salt), numbered({4, 6}, at::kDouble, salt + 1),
               numbered({3}, at::kFloat, salt + 2), numbered({}, at::kLong, salt + 3)};
    layouts = {Layout(flat, {Shard(0)}), Layout(wide, {Replicate(), Shard(1)}),
               Layout(flat, {Replicate()}), Layout()};
    for (size_t k = 0; k < keys.size(); ++k) {
      live.push_back(layouts[k].defined()
                         ? distribute_tensor(globals[k], layouts[k]).local().clone()
                         : globals[k].clone());
    }
  }

  State state() const {
    State s;
    for (size_t k = 0; k < keys.size(); ++k) {
      if (layouts[k].defined()) {
        s.add(keys[k], live[k], layouts[k], globals[k].sizes().vec());
      } else {
        s.add(keys[k], live[k]);
      }
    }
    return s;
  }

  // Loads `path` into zeroed pieces of the same layouts (other keys of the
  // checkpoint ignored) and checks them against `expected`'s pieces.
  void expect_saved_in(const std::string& path, const Pieces& expected) const {
    State into;
    std::vector<at::Tensor> loaded;
    for (size_t k = 0; k < keys.size(); ++k) {
      loaded.push_back(at::zeros_like(live[k]));
      if (layouts[k].defined()) {
        into.add(keys[k], loaded[k], layouts[k], globals[k].sizes().vec());
      } else {
        into.add(keys[k], loaded[k]);
      }
    }
    load(into, path, {/*strict=*/false});
    for (size_t k = 0; k < keys.size(); ++k) {
      EXPECT_TRUE(tensors_equal(loaded[k], expected.live[k])) << keys[k] << " from " << path;
    }
  }
};

TEST(AsyncCheckpoint, TheCheckpointHoldsTheValuesAtSaveTime) {
  SharedTempDir dir("async_snapshot");
  Pieces pieces(1);
  const Pieces at_save(1);
  int64_t step = 7;
  AsyncCheckpointer checkpointer;
  std::promise<void> changed;
  std::shared_future<void> changed_future = changed.get_future().share();
  SaveOptions options;
  // The write waits until the live tensors have changed (bounded, so that a
  // save that never returns before writing fails instead of hanging).
  options.before_rank_file = [changed_future] {
    changed_future.wait_for(std::chrono::seconds(30));
  };
  {
    State state = pieces.state();
    add_int(state, "train.step", step);
    checkpointer.save(state, dir.path(), 7, options);
  }  // the state goes away: the snapshot is the checkpointer's
  {
    torch::NoGradGuard no_grad;
    for (at::Tensor& t : pieces.live) t.fill_(-1);
  }
  step = -1;
  changed.set_value();
  const SaveResult result = checkpointer.wait();
  EXPECT_EQ(result.path, dir / "step-00000007");
  EXPECT_EQ(latest_checkpoint(dir.path()), result.path);
  pieces.expect_saved_in(result.path, at_save);
  State step_only;
  int64_t loaded_step = 0;
  add_int(step_only, "train.step", loaded_step);
  load(step_only, result.path, {/*strict=*/false});
  EXPECT_EQ(loaded_step, 7);
}

TEST(AsyncCheckpoint, WritesTheSameFilesAsASynchronousSave) {
  SharedTempDir dir("async_same");
  Pieces pieces(2);
  const SaveResult sync = save(pieces.state(), dir / "sync", 3);
  AsyncCheckpointer checkpointer;
  checkpointer.save(pieces.state(), dir / "async", 3);
  const SaveResult async = checkpointer.wait();
  EXPECT_EQ(async.rank_bytes, sync.rank_bytes);
  EXPECT_EQ(async.total_bytes, sync.total_bytes);
  for (const auto& entry : std::filesystem::directory_iterator(sync.path)) {
    const std::string name = entry.path().filename().string();
    EXPECT_EQ(read_whole_file(async.path + "/" + name), read_whole_file(entry.path().string()))
        << name;
  }
}

TEST(AsyncCheckpoint, SavesRunOneAtATimeAndEachHoldsItsOwnValues) {
  SharedTempDir dir("async_sequence");
  AsyncCheckpointer checkpointer;
  EXPECT_EQ(checkpointer.wait().path, "");  // nothing saved yet
  for (int64_t s = 1; s <= 3; ++s) {
    Pieces pieces(10 * s);
    checkpointer.save(pieces.state(), dir.path(), s);  // waits for save s - 1
    EXPECT_TRUE(checkpointer.in_flight());
  }
  EXPECT_EQ(checkpointer.wait().path, dir / "step-00000003");
  EXPECT_FALSE(checkpointer.in_flight());
  for (int64_t s = 1; s <= 3; ++s) {
    const Pieces expected(10 * s);
    expected.expect_saved_in(dir / checkpoint_dir_name(s), expected);
  }
}

// Staging buffers are kept: a second save of the same shapes allocates none
// of them. A piece large enough that a new staging buffer for it (its bytes
// at least) stands far above what the background thread allocates meanwhile
// (the reports' exchange: a few int64 tensors of at most world x (4 + 2 x
// pieces) elements, under 1 KiB).
TEST(AsyncCheckpoint, ASecondSaveOfTheSameShapesAllocatesNoStaging) {
  SharedTempDir dir("async_staging");
  enable_memory_tracking();
  const int64_t w = test::world_size();
  const Layout shard(init_device_mesh("cpu", {w}, {"shard"}), {Shard(0)});
  const std::vector<int64_t> shape = {64 * w, 256};  // 64 KiB of floats per rank
  at::Tensor live = distribute_tensor(at::rand(shape), shard).local().clone();
  State state;
  state.add("w", live, shard, shape);
  const int64_t piece_bytes = static_cast<int64_t>(live.nbytes());
  AsyncCheckpointer checkpointer;
  for (int s = 0; s < 2; ++s) {
    const int64_t before = memory_stats().current_bytes;
    reset_peak_memory();
    checkpointer.save(state, dir.path(), s);
    const int64_t extra = memory_stats().peak_bytes - before;
    if (s == 0) {
      EXPECT_GE(extra, piece_bytes) << "the first save allocates its staging";
    } else {
      EXPECT_LT(extra, piece_bytes) << "the second save reallocated its staging";
    }
    EXPECT_EQ(checkpointer.staging_bytes(), static_cast<uint64_t>(piece_bytes));
    checkpointer.wait();
  }
}

TEST(AsyncCheckpoint, ABackgroundFailureReachesEveryRankThroughTheNextCall) {
  SharedTempDir dir("async_failure");
  Pieces pieces(3);
  const int last = test::world_size() - 1;
  AsyncCheckpointer checkpointer;
  checkpointer.save(pieces.state(), dir.path(), 1);
  const std::string good = checkpointer.wait().path;
  SaveOptions failing;
  failing.before_rank_file = [last] {
    if (test::rank() == last) throw std::runtime_error("disk full on the last rank");
  };
  // Raised by wait() ...
  checkpointer.save(pieces.state(), dir.path(), 2, failing);
  EXPECT_THAT([&] { checkpointer.wait(); },
              ThrowsMessage<CheckpointError>(HasSubstr("disk full on the last rank")));
  // The failed save's temporary directory is gone (rank 0 removes it).
  SharedTempDir::sync();
  EXPECT_FALSE(std::filesystem::exists(dir / ".tmp-step-00000002"));
  // ... or by the next save(), which then starts nothing; raised once.
  checkpointer.save(pieces.state(), dir.path(), 2, failing);
  EXPECT_THAT([&] { checkpointer.save(pieces.state(), dir.path(), 4); },
              ThrowsMessage<CheckpointError>(HasSubstr("disk full on the last rank")));
  EXPECT_FALSE(checkpointer.in_flight());
  EXPECT_EQ(latest_checkpoint(dir.path()), good);
  // Bad input is raised by save() itself, on every rank, before any copy.
  EXPECT_THAT([&] { checkpointer.save(pieces.state(), dir.path(), -1); },
              ThrowsMessage<ArgumentError>(HasSubstr("step must be >= 0, got -1")));
  // The checkpointer goes on saving.
  checkpointer.save(pieces.state(), dir.path(), 3);
  EXPECT_EQ(checkpointer.wait().path, dir / "step-00000003");
  pieces.expect_saved_in(dir / "step-00000003", pieces);
}

// Staging in the background: save() returns before the copy (the copy,
// held by a test hook, sees that save() returned; a save() that copied, or
// waited for the copy, would leave the hook waiting out its bound), and
// wait_for_staging() returns once the copy is done: the live tensors may
// change from then on, and the checkpoint holds the values at save time.
TEST(AsyncCheckpoint, StagingInTheBackgroundCopiesAfterSaveReturned) {
  SharedTempDir dir("async_background");
  Pieces pieces(5);
  const Pieces at_save(5);
  AsyncCheckpointer checkpointer;
  std::promise<void> returned;
  std::shared_future<void> returned_future = returned.get_future().share();
  auto copied_after_return = std::make_shared<std::atomic<bool>>(false);
  SaveOptions options;
  options.before_staging = [returned_future, copied_after_return] {
    *copied_after_return =
        returned_future.wait_for(std::chrono::seconds(10)) == std::future_status::ready;
  };
  checkpointer.save(pieces.state(), dir.path(), 5, options, Staging::kInBackground);
  returned.set_value();
  checkpointer.wait_for_staging();
  {
    torch::NoGradGuard no_grad;
    for (at::Tensor& t : pieces.live) t.fill_(-1);
  }
  const SaveResult result = checkpointer.wait();
  EXPECT_TRUE(*copied_after_return);
  EXPECT_EQ(result.path, dir / "step-00000005");
  pieces.expect_saved_in(result.path, at_save);
  checkpointer.wait_for_staging();  // nothing staging: returns at once
}

// A tensor changed in place before its copy ended (here on the last rank,
// while the hook holds the copy back) fails that save on every rank, naming
// the mistake; no checkpoint of a mix of two states is committed.
TEST(AsyncCheckpoint, AStateChangedBeforeItsStagingEndedFailsTheSaveOnEveryRank) {
  SharedTempDir dir("async_torn");
  Pieces pieces(6);
  AsyncCheckpointer checkpointer;
  std::promise<void> changed;
  std::shared_future<void> changed_future = changed.get_future().share();
  SaveOptions options;
  options.before_staging = [changed_future] {
    changed_future.wait_for(std::chrono::seconds(30));
  };
  checkpointer.save(pieces.state(), dir.path(), 6, options, Staging::kInBackground);
  if (test::rank() == test::world_size() - 1) {
    torch::NoGradGuard no_grad;
    for (at::Tensor& t : pieces.live) t.add_(1);
  }
  changed.set_value();
  checkpointer.wait_for_staging();
  EXPECT_THAT([&] { checkpointer.wait(); },
              ThrowsMessage<CheckpointError>(AllOf(
                  HasSubstr("changed while the save of step 6 copied it"),
                  HasSubstr("call wait_for_staging() before changing the state"))));
  EXPECT_EQ(latest_checkpoint(dir.path()), std::nullopt);
}

TEST(AsyncCheckpoint, TheDestructorWaitsForTheSaveInFlight) {
  SharedTempDir dir("async_destructor");
  Pieces pieces(4);
  {
    AsyncCheckpointer checkpointer;
    checkpointer.save(pieces.state(), dir.path(), 5);
  }
  EXPECT_EQ(latest_checkpoint(dir.path()), dir / "step-00000005");
  pieces.expect_saved_in(dir / "step-00000005", pieces);
}

}  // namespace
}  // namespace hp::checkpoint
