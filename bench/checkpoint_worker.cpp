// hp-bench's checkpoint measurement (`--rows checkpoint`): save and load of
// a ~100M-parameter GPT (weights and AdamW's two moments, fp32: ~1.2 GB,
// plus the step counters) sharded by FSDP over the ranks, beside a plain
// sequential write and read of the same bytes per rank in the same
// directory, in the same run.
//
// Each phase starts after a barrier and its time is the slowest rank's. A
// phase's GB/s is all ranks' bytes over that time. The plain write writes
// each rank's checkpoint file size from one 64 MiB buffer and fsyncs, as
// the checkpoint does; before each read phase the files' cached pages are
// dropped (posix_fadvise DONTNEED after fsync), so both reads come from the
// device rather than from memory that the write left behind. Peak extra
// memory is hp::memory_stats's peak during save above what was allocated
// before it, per rank, against the largest piece a rank holds (one file
// buffer's worth: the writer writes each piece from its own memory and
// copies at most a strided one).
//
// Then the same model trains (FSDP, AdamW, kTrainBatch x kTrainSeq random
// tokens per rank per step) with checkpoints in the loop, side by side:
// steps without a save; synchronous saves, whose stall is the whole save;
// AsyncCheckpointer saves (C7) staged in the background, as hp-train
// --save-async saves, whose stall is save()'s agreed checks plus the next
// optimizer step's wait for the copy, each followed by kStepsAfterAsync
// steps. A step overlaps a background write
// when it started before the write's commit on some rank. Every time is the
// slowest rank's.
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <unistd.h>

#include <ATen/Parallel.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <iostream>
#include <nlohmann/json.hpp>

#include "bench/bench_worker.h"
#include "bench/median.h"
#include "hp/checkpoint/async_save.h"
#include "hp/checkpoint/checkpoint.h"
#include "hp/checkpoint/training_state.h"
#include "hp/distributed/collectives.h"
#include "hp/distributed/world.h"
#include "hp/fsdp/fully_shard.h"
#include "hp/mesh/device_mesh.h"
#include "hp/nn/gpt.h"
#include "hp/nn/loss.h"
#include "hp/util/env.h"
#include "hp/util/error.h"
#include "hp/util/memory_stats.h"

namespace hp::bench {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// The slowest rank's value.
double max_over_ranks(double v) {
  at::Tensor t = at::full({1}, v, at::kDouble);
  dist::all_reduce(*dist::world_group(), t, dist::ReduceOp::kMax).wait();
  return t.item<double>();
}

double sum_over_ranks(double v) {
  at::Tensor t = at::full({1}, v, at::kDouble);
  dist::all_reduce(*dist::world_group(), t, dist::ReduceOp::kSum).wait();
  return t.item<double>();
}

void barrier() { dist::barrier(*dist::world_group()).wait(); }

constexpr size_t kBlock = 64 << 20;

void check(bool ok, const std::string& what) {
  if (!ok) throw std::runtime_error(what + ": " + std::strerror(errno));
}

void plain_write(const std::string& path, uint64_t bytes, std::vector<char>& buffer) {
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  check(fd >= 0, "open " + path);
  for (uint64_t done = 0; done < bytes;) {
    const size_t n = static_cast<size_t>(std::min<uint64_t>(kBlock, bytes - done));
    const ssize_t put = ::write(fd, buffer.data(), n);
    check(put > 0, "write " + path);
    done += static_cast<uint64_t>(put);
  }
  check(::fsync(fd) == 0, "fsync " + path);
  ::close(fd);
}

void plain_read(const std::string& path, std::vector<char>& buffer) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  check(fd >= 0, "open " + path);
  while (true) {
    const ssize_t got = ::read(fd, buffer.data(), buffer.size());
    check(got >= 0, "read " + path);
    if (got == 0) break;
  }
  ::close(fd);
}

// Drops the cached pages of every file under `dir` (they are clean: written
// and fsynced), so the next read goes to the device.
void drop_cache(const fs::path& dir) {
  for (const auto& entry : fs::recursive_directory_iterator(dir)) {
    if (!entry.is_regular_file()) continue;
    int fd = ::open(entry.path().c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) continue;
    ::fdatasync(fd);
    ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    ::close(fd);
  }
}

std::string filesystem_of(const std::string& path) {
  struct statfs s {};
  if (::statfs(path.c_str(), &s) != 0) return "unknown";
  switch (static_cast<unsigned long>(s.f_type)) {
    case 0xEF53: return "ext4";
    case 0x01021994: return "tmpfs";
    case 0x58465342: return "xfs";
    case 0x794c7630: return "overlayfs";
    case 0x9123683E: return "btrfs";
    default: return fmt::format("0x{:x}", static_cast<unsigned long>(s.f_type));
  }
}

// The training measured with checkpoints: small steps, so that a save spans
// several of them on 2 CPU cores.
constexpr int64_t kTrainBatch = 2;
constexpr int64_t kTrainSeq = 64;
constexpr int kStepsWithoutSave = 4;
constexpr int kStepsAfterAsync = 4;

}  // namespace

int run_checkpoint_worker(const BenchConfig& c) {
  at::set_num_threads(1);
  dist::init_process_group();
  const int rank = dist::get_rank();
  const int world = dist::get_world_size();
  enable_memory_tracking();

  const nn::GPTConfig config = c.gpt_config(c.ckpt_layers, c.ckpt_d);
  torch::manual_seed(c.seed);
  nn::GPT model(config);
  int64_t parameters = 0;
  for (const auto& p : model->parameters()) parameters += p.numel();
  FullyShardOptions options;
  options.mesh = init_device_mesh("cpu", {world}, {"shard"});
  for (const nn::Block& block : model->blocks()) fully_shard(block.ptr(), options);
  FSDPModule root = fully_shard(model.ptr(), options);
  torch::optim::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(c.lr));
  int64_t step = 1;
  checkpoint::State state;
  checkpoint::add_model(state, *model);
  checkpoint::add_adamw(state, optimizer, *model);
  checkpoint::add_int(state, "train.step", step);
  {
    // Moments that are not all zeros (a file system could store those sparsely).
    torch::NoGradGuard no_grad;
    for (const checkpoint::StateEntry& e : state.entries()) {
      if (e.key.find(".exp_avg") != std::string::npos) e.local.copy_(at::randn_like(e.local).abs_());
    }
  }

  // The bound on save's extra memory: one piece, the largest this rank holds
  // (a writer that copies at most one piece at a time stays under it).
  double largest_piece = 0;
  for (const checkpoint::StateEntry& e : state.entries()) {
    largest_piece = std::max(largest_piece, static_cast<double>(e.local.nbytes()));
  }
  largest_piece = max_over_ranks(largest_piece);

  // One directory per job (its rendezvous port); getenv's null would crash fmt.
  const auto port = hp::env::get_int("MASTER_PORT", 1, 65535);
  HP_CHECK_ARG(port.has_value(), "MASTER_PORT is not set; run under hprun");
  const fs::path dir = fs::path(c.ckpt_dir) / fmt::format("job-{}", *port);
  if (rank == 0) fs::create_directories(dir / "plain");
  barrier();
  std::vector<char> buffer(kBlock, 1);

  nlohmann::json repeats = nlohmann::json::array();
  for (int repeat = 0; repeat < c.ckpt_repeats; ++repeat) {
    // Save.
    barrier();
    const int64_t before = memory_stats().current_bytes;
    reset_peak_memory();
    auto t0 = Clock::now();
    const checkpoint::SaveResult saved = checkpoint::save(state, (dir / "ckpt").string(), repeat);
    const double save_s = max_over_ranks(seconds_since(t0));
    const double peak_extra = max_over_ranks(static_cast<double>(memory_stats().peak_bytes - before));
    const double total_bytes = static_cast<double>(saved.total_bytes);

    // A plain write of this rank's file size.
    const std::string plain = (dir / "plain" / fmt::format("rank-{}.bin", rank)).string();
    barrier();
    t0 = Clock::now();
    plain_write(plain, saved.rank_bytes, buffer);
    const double write_s = max_over_ranks(seconds_since(t0));
    const double plain_bytes = sum_over_ranks(static_cast<double>(saved.rank_bytes));

    // Reads, from the device.
    barrier();
    if (rank == 0) drop_cache(dir);
    barrier();
    t0 = Clock::now();
    const checkpoint::LoadResult loaded = checkpoint::load(state, saved.path);
    const double load_s = max_over_ranks(seconds_since(t0));
    const double read_bytes = sum_over_ranks(static_cast<double>(loaded.bytes_read));
    barrier();
    if (rank == 0) drop_cache(dir);
    barrier();
    t0 = Clock::now();
    plain_read(plain, buffer);
    const double read_s = max_over_ranks(seconds_since(t0));

    repeats.push_back({{"save_s", save_s},
                       {"save_gb_per_s", total_bytes / save_s / 1e9},
                       {"plain_write_s", write_s},
                       {"plain_write_gb_per_s", plain_bytes / write_s / 1e9},
                       {"load_s", load_s},
                       {"load_gb_per_s", read_bytes / load_s / 1e9},
                       {"plain_read_s", read_s},
                       {"plain_read_gb_per_s", plain_bytes / read_s / 1e9},
                       {"checkpoint_bytes", total_bytes},
                       {"load_bytes_read", read_bytes},
                       {"peak_extra_bytes_during_save_per_rank", peak_extra}});
    if (rank == 0) std::cerr << "checkpoint repeat " << repeat << ": " << repeats.back().dump() << std::endl;
  }
  // --- training with checkpoints in the loop ---
  at::Generator tokens_rng = at::make_generator<at::CPUGeneratorImpl>(c.seed + rank);
  // Before the optimizer changes the state, a save copying it in the
  // background is waited for; the wait counts as stall.
  checkpoint::AsyncCheckpointer* staging = nullptr;
  double staging_wait_s = 0;
  auto train_step = [&] {
    root.zero_grad();
    at::Tensor tokens = at::randint(c.vocab, {kTrainBatch, kTrainSeq + 1}, tokens_rng);
    at::Tensor loss = nn::cross_entropy(model(tokens.narrow(1, 0, kTrainSeq)),
                                        tokens.narrow(1, 1, kTrainSeq));
    loss.backward();
    if (staging) {
      const auto t0 = Clock::now();
      staging->wait_for_staging();
      staging_wait_s += seconds_since(t0);
    }
    optimizer.step();
  };
  // The state now (AdamW's state exists after the first step).
  auto current_state = [&] {
    checkpoint::State s;
    checkpoint::add_model(s, *model);
    checkpoint::add_adamw(s, optimizer, *model);
    checkpoint::add_int(s, "train.step", step);
    return s;
  };
  const std::string train_root = (dir / "train").string();
  // Keeps the disk to one checkpoint: the previous one goes once a new one is in.
  auto drop_step = [&](int64_t s) {
    barrier();
    if (rank == 0) fs::remove_all(fs::path(train_root) / checkpoint::checkpoint_dir_name(s));
  };
  train_step();  // warm-up; creates AdamW's state
  std::vector<double> plain_steps;
  for (int i = 0; i < kStepsWithoutSave; ++i) {
    barrier();
    const auto t0 = Clock::now();
    train_step();
    plain_steps.push_back(max_over_ranks(seconds_since(t0)));
  }
  nlohmann::json sync_saves = nlohmann::json::array();
  for (int repeat = 0; repeat < c.ckpt_repeats; ++repeat) {
    step = 100 + repeat;
    barrier();
    const auto t0 = Clock::now();
    checkpoint::save(current_state(), train_root, step);
    sync_saves.push_back({{"stall_s", max_over_ranks(seconds_since(t0))}});
    train_step();
    drop_step(step);
  }
  nlohmann::json async_saves = nlohmann::json::array();
  {
    checkpoint::AsyncCheckpointer checkpointer;
    staging = &checkpointer;
    for (int repeat = 0; repeat < c.ckpt_repeats; ++repeat) {
      step = 200 + repeat;
      barrier();
      const auto t0 = Clock::now();
      // As hp-train --save-async saves: the copy on the background thread
      // too, waited for before the next optimizer step.
      checkpointer.save(current_state(), train_root, step, {},
                        checkpoint::Staging::kInBackground);
      const double returned_s = seconds_since(t0);
      staging_wait_s = 0;
      std::vector<double> starts, times;
      for (int i = 0; i < kStepsAfterAsync; ++i) {
        const auto s0 = Clock::now();
        starts.push_back(std::chrono::duration<double>(s0 - t0).count());
        train_step();
        times.push_back(seconds_since(s0));
      }
      const double stall = returned_s + staging_wait_s;
      const checkpoint::SaveResult saved = checkpointer.wait();
      // This rank's commit, from save()'s call: SaveResult::seconds runs
      // from the save's checks (no save was in flight to wait for) through
      // the copy and the write.
      const double write_end = saved.seconds;
      nlohmann::json steps = nlohmann::json::array();
      for (int i = 0; i < kStepsAfterAsync; ++i) {
        const bool overlapped = max_over_ranks(starts[i] < write_end ? 1 : 0) > 0;
        steps.push_back({{"step_s", max_over_ranks(times[i])}, {"overlapped", overlapped}});
      }
      async_saves.push_back({{"stall_s", max_over_ranks(stall)},
                             {"write_s", max_over_ranks(saved.seconds)},
                             {"steps", steps}});
      drop_step(step);
    }
    staging = nullptr;
  }
  std::vector<double> overlapped;
  for (const auto& save : async_saves) {
    for (const auto& s : save["steps"]) {
      if (s["overlapped"].get<bool>()) overlapped.push_back(s["step_s"].get<double>());
    }
  }
  std::vector<double> sync_stalls, async_stalls;
  for (const auto& save : sync_saves) sync_stalls.push_back(save["stall_s"].get<double>());
  for (const auto& save : async_saves) async_stalls.push_back(save["stall_s"].get<double>());
  const nlohmann::json training = {
      {"tokens_per_rank_per_step", kTrainBatch * kTrainSeq},
      {"steps_without_save_s", plain_steps},
      {"sync_saves", sync_saves},
      {"async_saves", async_saves},
      {"median_step_without_save_s", median(plain_steps)},
      {"median_step_overlapping_write_s", median(overlapped)},
      {"overlapping_steps", overlapped.size()},
      {"median_sync_stall_s", median(sync_stalls)},
      {"median_async_stall_s", median(async_stalls)}};
  if (rank == 0) std::cerr << "checkpoint training: " << training.dump() << std::endl;

  barrier();
  if (rank == 0) fs::remove_all(dir);
  if (rank == 0) {
    nlohmann::json out = {{"parameters", parameters},
                          {"ranks", world},
                          {"layers", c.ckpt_layers},
                          {"d", c.ckpt_d},
                          {"directory", c.ckpt_dir},
                          {"filesystem", filesystem_of(c.ckpt_dir)},
                          {"largest_piece_bytes", largest_piece},
                          {"repeats", repeats},
                          {"training", training}};
    std::cout << kResultMarker << out.dump() << std::endl;
  }
  barrier();
  dist::destroy_process_group();
  return 0;
}

}  // namespace hp::bench
