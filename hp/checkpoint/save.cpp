// save(): the writing half of checkpoint.h, and the halves of every save
// (save_core.h).
#include <ATen/ATen.h>

#include <chrono>
#include <filesystem>
#include <iostream>
#include <mutex>

#include "hp/checkpoint/agreement.h"
#include "hp/checkpoint/checkpoint.h"
#include "hp/checkpoint/crc32c.h"
#include "hp/checkpoint/directory.h"
#include "hp/checkpoint/file_io.h"
#include "hp/checkpoint/metadata.h"
#include "hp/checkpoint/plan.h"
#include "hp/checkpoint/root_lock.h"
#include "hp/checkpoint/save_core.h"
#include "hp/checkpoint/safetensors.h"
#include "hp/distributed/collectives.h"
#include "hp/distributed/world.h"
#include "hp/util/error.h"

namespace hp::checkpoint {
namespace {

struct World {
  int rank = 0;
  int size = 1;
};

World this_world() {
  if (!dist::is_initialized()) return {};
  return {dist::get_rank(), dist::get_world_size()};
}

// Whether this rank's piece has the shape its layout gives it. Local; the
// caller agrees on the outcome.
void check_piece(const StateEntry& entry, const char* what) {
  const Box box = local_box(entry);
  HP_CHECK_ARG(box.sizes == entry.local.sizes().vec(), what, ": tensor '", entry.key,
               "' has a local piece of shape ", to_string(entry.local.sizes().vec()), " on rank ",
               this_world().rank, ", but ",
               entry.layout.defined() ? entry.layout.str() : std::string("a whole tensor"),
               " of global shape ", to_string(entry.shape), " gives it ", to_string(box.sizes));
}

// What one rank wrote, as every rank learns it: its file and, per chunk it
// owns (in state order), where the chunk lies and its checksum.
struct RankReport {
  bool has_file = false;
  uint64_t file_bytes = 0;
  uint64_t header_bytes = 0;
  uint32_t header_crc = 0;
  std::vector<std::pair<uint64_t, uint32_t>> chunks;  // (byte offset, crc32c)
};

constexpr int64_t kReportHead = 4;

at::Tensor encode(const RankReport& report, int64_t length) {
  at::Tensor t = at::zeros({length}, at::kLong);
  auto* p = t.data_ptr<int64_t>();
  p[0] = report.has_file;
  p[1] = static_cast<int64_t>(report.file_bytes);
  p[2] = static_cast<int64_t>(report.header_bytes);
  p[3] = report.header_crc;
  for (size_t i = 0; i < report.chunks.size(); ++i) {
    p[kReportHead + 2 * i] = static_cast<int64_t>(report.chunks[i].first);
    p[kReportHead + 2 * i + 1] = report.chunks[i].second;
  }
  return t;
}

RankReport decode(const int64_t* p, int64_t chunks) {
  RankReport r;
  r.has_file = p[0] != 0;
  r.file_bytes = static_cast<uint64_t>(p[1]);
  r.header_bytes = static_cast<uint64_t>(p[2]);
  r.header_crc = static_cast<uint32_t>(p[3]);
  for (int64_t i = 0; i < chunks; ++i) {
    r.chunks.emplace_back(static_cast<uint64_t>(p[kReportHead + 2 * i]),
                          static_cast<uint32_t>(p[kReportHead + 2 * i + 1]));
  }
  return r;
}

// A piece's bytes in host memory, for the file. A contiguous CPU piece is
// written from its own memory and a strided one copied; a GPU piece is
// copied into pinned host memory (a full-bandwidth transfer, which a copy
// into pageable memory is not). One piece at a time: the staging memory is
// one piece's, not the state's.
at::Tensor host_piece(const at::Tensor& local) {
  at::Tensor piece = local.detach();
  if (piece.is_cpu()) return piece.contiguous();
  at::Tensor host =
      at::empty(piece.sizes(), piece.options().device(at::kCPU).pinned_memory(true));
  host.copy_(piece);
  return host;
}

// Writes this rank's file (if it owns any chunk) and reports it.
RankReport write_rank_file(const SavePlan& plan, const std::vector<at::Tensor>& pieces,
                           const std::string& path) {
  RankReport report;
  if (pieces.empty()) return report;
  std::vector<SafetensorsSpec> specs;
  for (size_t i : plan.owned) {
    const SavePlan::Entry& e = plan.entries[i];
    specs.push_back({e.key, e.dtype, e.local_sizes});
  }
  SafetensorsWriter writer(path, specs);
  for (const at::Tensor& piece : pieces) {
    at::Tensor data = host_piece(piece);
    report.chunks.emplace_back(0, crc32c(0, data.data_ptr(), data.nbytes()));
    writer.write(data);
  }
  writer.commit();
  // The offsets as the file records them, and the header under a checksum.
  const SafetensorsIndex index = read_safetensors_index(path);
  for (size_t i = 0; i < pieces.size(); ++i) report.chunks[i].first = index.entries.at(i).offset;
  std::string header(index.data_start, '\0');
  Fd fd(open_for_reading(path));
  read_exact(fd.get(), header.data(), header.size(), 0, path);
  report.has_file = true;
  report.file_bytes = index.file_size;
  report.header_bytes = index.data_start;
  report.header_crc = crc32c(0, header.data(), header.size());
  return report;
}

// Rank 0's part of claim_root and of every save's start: ROOT's lock, then
// what crashed or failed saves left there (directory.h).
void claim_on_this_rank(const std::string& root) {
  std::lock_guard<std::mutex> guard(root_directory_mutex());
  const bool taken = lock_root(root);
  for (const std::string& line : recover_leftovers(root, /*remove_temps=*/taken)) {
    std::cerr << "hp::checkpoint: " << line << std::endl;
  }
}

// write_save's stages after the temporary directory is prepared.
SaveResult write_prepared(const SavePlan& plan, const std::vector<at::Tensor>& pieces,
                          const SaveOptions& options, dist::Group* group,
                          std::chrono::steady_clock::time_point start, const std::string& temp);

}  // namespace

void claim_root(const std::string& root) {
  run_agreed([&] {
    HP_CHECK_ARG(!root.empty(), "checkpoint::claim_root: the root directory must be non-empty");
    if (this_world().rank == 0) claim_on_this_rank(root);
  });
}

SavePlan plan_save(const State& state, const std::string& root, int64_t step,
                   dist::Group* group) {
  const World world = this_world();
  SavePlan plan;
  plan.root = root;
  plan.step = step;
  plan.rank = world.rank;
  plan.world_size = world.size;
  plan.owned_count.assign(static_cast<size_t>(world.size), 0);
  // Who writes what: the same plan on every rank.
  const auto& entries = state.entries();
  for (size_t i = 0; i < entries.size(); ++i) {
    const StateEntry& entry = entries[i];
    SavePlan::Entry planned{entry.key,
                            entry.local.scalar_type(),
                            entry.shape,
                            entry.local.sizes().vec(),
                            entry.layout.defined()   ? entry.layout.str()
                            : entry.holders.empty() ? std::string("whole on every rank")
                                                    : cat("whole on ranks ", to_string(entry.holders)),
                            plan_chunks(entry)};
    for (const PlannedChunk& c : planned.chunks) {
      ++plan.owned_count.at(static_cast<size_t>(c.writer));
      if (c.writer == world.rank) plan.owned.push_back(i);
    }
    plan.entries.push_back(std::move(planned));
  }
  // The plan above is only the same on every rank for the same states.
  const bool same_states = same_on_every_rank(state.signature(), group);
  run_agreed(
      [&] {
        HP_CHECK_ARG(same_states, "checkpoint::save: the ranks' states differ in their keys, "
                     "shapes, dtypes or layouts; every rank must save the same keys");
        HP_CHECK_ARG(step >= 0, "checkpoint::save: step must be >= 0, got ", step);
        HP_CHECK_ARG(!root.empty(), "checkpoint::save: the root directory must be non-empty");
        for (const StateEntry& entry : entries) check_piece(entry, "checkpoint::save");
      },
      group);
  return plan;
}

SaveResult write_save(const SavePlan& plan, const std::vector<at::Tensor>& pieces,
                      const SaveOptions& options, dist::Group* group,
                      std::chrono::steady_clock::time_point start) {
  HP_CHECK_ARG(pieces.size() == plan.owned.size(), "checkpoint::write_save: ", pieces.size(),
               " pieces for the ", plan.owned.size(), " this rank writes");
  const int rank = plan.rank;
  const std::string temp = temp_dir(plan.root, plan.step);
  run_agreed(
      [&] {
        if (rank != 0) return;
        claim_on_this_rank(plan.root);
        prepare_temp_dir(plan.root, plan.step);
      },
      group);
  // From here on the temporary directory is this save's: a failure removes
  // it (it may hold gigabytes), on rank 0, once every rank has stopped
  // writing into it (each stage is agreed, so every rank raises together).
  try {
    return write_prepared(plan, pieces, options, group, start, temp);
  } catch (...) {
    if (rank == 0) {
      std::lock_guard<std::mutex> guard(root_directory_mutex());
      std::error_code ec;
      std::filesystem::remove_all(temp, ec);
      if (ec) {
        std::cerr << "hp::checkpoint: the failed save of step " << plan.step
                  << " could not remove " << temp << ": " << ec.message() << std::endl;
      }
    }
    throw;
  }
}

namespace {

SaveResult write_prepared(const SavePlan& plan, const std::vector<at::Tensor>& pieces,
                          const SaveOptions& options, dist::Group* group,
                          std::chrono::steady_clock::time_point start, const std::string& temp) {
  const int rank = plan.rank;
  const int size = plan.world_size;
  RankReport mine;
  run_agreed(
      [&] {
        if (options.before_rank_file) options.before_rank_file();
        mine = write_rank_file(plan, pieces, temp + "/" + rank_file_name(rank));
      },
      group);
  if (options.after_rank_file) options.after_rank_file();

  // Every rank's report, so rank 0 can write the index.
  int64_t length = kReportHead;
  for (int64_t n : plan.owned_count) length = std::max(length, kReportHead + 2 * n);
  at::Tensor all = encode(mine, length);
  if (size > 1) {
    at::Tensor gathered = at::empty({size * length}, at::kLong);
    dist::Group& g = group != nullptr ? *group : *dist::world_group();
    dist::all_gather_into(g, gathered, all).wait();
    all = gathered;
  }
  std::vector<RankReport> reports;
  for (int r = 0; r < size; ++r) {
    reports.push_back(decode(all.data_ptr<int64_t>() + r * length, plan.owned_count[r]));
  }

  run_agreed(
      [&] {
        if (rank != 0) return;
        Metadata metadata;
        metadata.step = plan.step;
        metadata.world_size = size;
        for (int r = 0; r < size; ++r) {
          const RankReport& report = reports[r];
          if (report.has_file) {
            metadata.files[rank_file_name(r)] = {report.file_bytes, report.header_bytes,
                                                 report.header_crc};
          }
        }
        std::vector<size_t> next(static_cast<size_t>(size), 0);
        for (const SavePlan::Entry& entry : plan.entries) {
          TensorRecord record;
          record.dtype = *safetensors_dtype_name(entry.dtype);
          record.shape = entry.shape;
          record.layout = entry.layout;
          for (const PlannedChunk& c : entry.chunks) {
            const auto& [offset, crc] = reports[c.writer].chunks.at(next[c.writer]++);
            record.chunks.push_back({c.box.offsets, c.box.sizes, rank_file_name(c.writer),
                                     offset,
                                     static_cast<uint64_t>(c.box.numel()) *
                                         at::elementSize(entry.dtype),
                                     crc});
          }
          metadata.tensors.emplace_back(entry.key, std::move(record));
        }
        write_file_atomically(temp + "/" + kMetadataFile, metadata.to_json());
        if (options.before_commit) options.before_commit();
        std::lock_guard<std::mutex> guard(root_directory_mutex());
        commit_dir(plan.root, temp, plan.step);
      },
      group);

  SaveResult result;
  result.path = (std::filesystem::path(plan.root) / checkpoint_dir_name(plan.step)).string();
  result.rank_bytes = mine.file_bytes;
  for (const RankReport& r : reports) result.total_bytes += r.file_bytes;
  std::error_code ec;
  const auto metadata_bytes =
      std::filesystem::file_size(std::filesystem::path(result.path) / kMetadataFile, ec);
  if (!ec) result.total_bytes += metadata_bytes;
  result.seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return result;
}

}  // namespace

SaveResult save(const State& state, const std::string& root, int64_t step,
                const SaveOptions& options) {
  const auto start = std::chrono::steady_clock::now();
  const SavePlan plan = plan_save(state, root, step, nullptr);
  // The live pieces: write_save copies at most one at a time (host_piece).
  std::vector<at::Tensor> pieces;
  for (size_t i : plan.owned) pieces.push_back(state.entries()[i].local);
  SaveResult result = write_save(plan, pieces, options, nullptr, start);
  result.stall_seconds = result.seconds;
  return result;
}

}  // namespace hp::checkpoint
