// load(): the reading half of checkpoint.h, and its core shared with the
// import of a consolidated file (consolidated.h).
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <sys/stat.h>

#include <chrono>
#include <filesystem>
#include <iostream>
#include <map>
#include <set>

#include "hp/checkpoint/agreement.h"
#include "hp/checkpoint/checkpoint.h"
#include "hp/checkpoint/crc32c.h"
#include "hp/checkpoint/directory.h"
#include "hp/checkpoint/file_io.h"
#include "hp/checkpoint/load_core.h"
#include "hp/checkpoint/metadata.h"
#include "hp/checkpoint/plan.h"
#include "hp/checkpoint/safetensors.h"
#include "hp/distributed/world.h"
#include "hp/util/error.h"

namespace hp::checkpoint {
namespace {

std::string quoted_list(const std::vector<std::string>& keys) {
  constexpr size_t kListed = 8;
  std::string s;
  for (size_t i = 0; i < keys.size() && i < kListed; ++i) s += cat(i ? ", " : "", "'", keys[i], "'");
  if (keys.size() > kListed) s += cat(" and ", keys.size() - kListed, " more");
  return s;
}

[[noreturn]] void fail_file(const std::string& path, const std::string& what) {
  throw CheckpointError(cat("checkpoint file ", path, ": ", what));
}

// The keys, shapes and dtypes of `state` against `metadata`.
void check_keys(const State& state, const Metadata& metadata, const std::string& source,
                const std::string& prefix, bool strict) {
  std::vector<std::string> missing, unexpected;
  for (const StateEntry& entry : state.entries()) {
    if (!metadata.find(entry.key.substr(prefix.size()))) missing.push_back(entry.key);
  }
  if (strict) {
    for (const auto& [key, record] : metadata.tensors) {
      if (!state.find(prefix + key)) unexpected.push_back(prefix + key);
    }
  }
  if (!missing.empty() || !unexpected.empty()) {
    std::string message = cat(source, " does not match the state:");
    if (!missing.empty()) message += cat(" missing key(s) ", quoted_list(missing), ";");
    if (!unexpected.empty()) message += cat(" unexpected key(s) ", quoted_list(unexpected), ";");
    message.back() = '.';
    throw_argument_error(message);
  }
  for (const StateEntry& entry : state.entries()) {
    const TensorRecord& record = *metadata.find(entry.key.substr(prefix.size()));
    HP_CHECK_ARG(record.shape == entry.shape, source, ": key '", entry.key, "' has shape ",
                 to_string(record.shape), " in the checkpoint but ", to_string(entry.shape),
                 " in the state");
    const std::string dtype = *safetensors_dtype_name(entry.local.scalar_type());
    HP_CHECK_ARG(record.dtype == dtype, source, ": key '", entry.key, "' has dtype ",
                 record.dtype, " in the checkpoint but ", dtype, " (", entry.local.scalar_type(),
                 ") in the state");
  }
}

// A file this rank reads: there, of its recorded size, its header intact.
void check_file(const std::string& dir, const std::string& name, const FileRecord& record) {
  const std::string path = dir + "/" + name;
  Fd fd(open_for_reading(path));
  struct stat st;
  if (::fstat(fd.get(), &st) != 0) fail_file(path, cat("cannot stat: ", errno_text()));
  const auto size = static_cast<uint64_t>(st.st_size);
  if (size != record.bytes) {
    fail_file(path, cat(size < record.bytes ? "truncated: " : "", "it has ", size,
                        " bytes but the checkpoint's metadata records ", record.bytes));
  }
  if (!record.header_crc32c) return;
  std::string header(record.header_bytes, '\0');
  read_exact(fd.get(), header.data(), header.size(), 0, path);
  const uint32_t crc = crc32c(0, header.data(), header.size());
  if (crc != *record.header_crc32c) {
    fail_file(path, cat("its header does not match its checksum (corrupt)"));
  }
}

// Reads `part` of a chunk holding `box` row-major at `offset` into `out`
// (contiguous, part's shape), as few contiguous runs as the geometry
// allows: the dims inside the innermost one the part cuts are whole, so a
// run spans them; a dim-0 piece is one run. Returns the bytes read.
uint64_t read_part(int fd, at::Tensor& out, const Box& box, const Box& part, uint64_t offset,
                   const std::string& path) {
  const int64_t ndim = static_cast<int64_t>(box.sizes.size());
  const auto element = static_cast<int64_t>(out.element_size());
  if (part.numel() == 0) return 0;
  int64_t cut = -1;  // the innermost dim the part does not cover whole
  for (int64_t d = ndim - 1; d >= 0; --d) {
    if (part.sizes[d] != box.sizes[d]) {
      cut = d;
      break;
    }
  }
  std::vector<int64_t> strides(ndim, 1);  // the chunk's, in elements
  for (int64_t d = ndim - 2; d >= 0; --d) strides[d] = strides[d + 1] * box.sizes[d + 1];
  const int64_t run_dim = std::max<int64_t>(cut, 0);
  const int64_t run = ndim == 0 ? 1 : part.sizes[run_dim] * strides[run_dim];
  // The outer dims (before run_dim) are walked in row-major order; runs
  // land one after another in `out`, which is part's row-major layout.
  std::vector<int64_t> index(std::max<int64_t>(run_dim, 0), 0);
  auto* dst = static_cast<char*>(out.data_ptr());
  uint64_t bytes = 0;
  while (true) {
    int64_t start = 0;
    for (int64_t d = 0; d < ndim; ++d) {
      const int64_t at = d < run_dim ? index[d] : 0;
      start += (part.offsets[d] - box.offsets[d] + at) * strides[d];
    }
    const auto n = static_cast<size_t>(run * element);
    read_exact(fd, dst, n, offset + static_cast<uint64_t>(start * element), path);
    dst += n;
    bytes += n;
    int64_t d = run_dim - 1;
    for (; d >= 0; --d) {
      if (++index[d] < part.sizes[d]) break;
      index[d] = 0;
    }
    if (d < 0) break;
  }
  return bytes;
}

}  // namespace

LoadResult load_from_metadata(State& state, const Metadata& metadata, const std::string& dir,
                              const std::string& source, const std::string& prefix, bool strict) {
  const auto start = std::chrono::steady_clock::now();
  LoadResult result;
  result.path = dir;
  result.step = metadata.step;

  // What this rank reads: per entry, the saved chunks its piece overlaps.
  struct Read {
    const StateEntry* entry;
    const ChunkRecord* chunk;
    Box box;   // the chunk's
    Box part;  // the overlap with this rank's piece
  };
  std::vector<Read> reads;
  const bool same_states = same_on_every_rank(state.signature());
  run_agreed([&] {
    HP_CHECK_ARG(same_states, source, ": the ranks' states differ in their keys, shapes, dtypes "
                 "or layouts; every rank must load the same keys");
    for (const StateEntry& entry : state.entries()) {
      HP_CHECK_ARG(entry.key.compare(0, prefix.size(), prefix) == 0, source, ": key '",
                   entry.key, "' of the state does not start with '", prefix, "'");
    }
    check_keys(state, metadata, source, prefix, strict);
    std::set<std::string> files;
    for (const StateEntry& entry : state.entries()) {
      const Box mine = local_box(entry);
      HP_CHECK_ARG(mine.sizes == entry.local.sizes().vec(), source, ": key '", entry.key,
                   "' has a local piece of shape ", to_string(entry.local.sizes().vec()),
                   " but its layout gives this rank ", to_string(mine.sizes));
      // A key this rank only declares is read by its holders.
      if (!entry.held_here || mine.numel() == 0) continue;
      for (const ChunkRecord& chunk : metadata.find(entry.key.substr(prefix.size()))->chunks) {
        Box box{chunk.offsets, chunk.sizes};
        if (auto part = intersect(mine, box)) {
          reads.push_back({&entry, &chunk, box, *part});
          files.insert(chunk.file);
        }
      }
    }
    for (const std::string& name : files) check_file(dir, name, metadata.files.at(name));
  });

  // Chunk by chunk: read, check, copy the overlap into the piece.
  run_agreed([&] {
    at::NoGradGuard no_grad;
    std::map<std::string, std::unique_ptr<Fd>> open;
    for (const Read& read : reads) {
      const std::string path = dir + "/" + read.chunk->file;
      auto& fd = open[read.chunk->file];
      if (!fd) fd = std::make_unique<Fd>(open_for_reading(path));
      const at::ScalarType dtype = read.entry->local.scalar_type();
      // Bool bytes are read as bytes, as the safetensors reader does.
      const at::ScalarType read_dtype = dtype == at::kBool ? at::kByte : dtype;
      const StateEntry& entry = *read.entry;
      at::Tensor part_data;
      if (read.chunk->crc32c) {
        // A checksum covers the whole chunk: read all of it.
        at::Tensor data = at::empty(read.box.sizes, read_dtype);
        read_exact(fd->get(), data.data_ptr(), read.chunk->bytes, read.chunk->byte_offset, path);
        result.bytes_read += read.chunk->bytes;
        if (crc32c(0, data.data_ptr(), read.chunk->bytes) != *read.chunk->crc32c) {
          fail_file(path, cat("the data of key '", read.entry->key,
                              "' does not match its checksum (corrupt); the tensors read "
                              "before it were already filled: load an intact checkpoint "
                              "again"));
        }
        part_data = view_of(data, read.box, read.part);
      } else {
        // No checksum (a consolidated file): only the overlap's bytes.
        part_data = at::empty(read.part.sizes, read_dtype);
        result.bytes_read += read_part(fd->get(), part_data, read.box, read.part,
                                       read.chunk->byte_offset, path);
      }
      if (dtype == at::kBool) part_data = part_data.to(at::kBool);
      view_of(entry.local.detach(), local_box(entry), read.part).copy_(part_data);
    }
  });
  state.run_on_loaded();
  result.seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return result;
}

namespace {

std::string step_words(int64_t step) {
  return step < 0 ? std::string("no complete checkpoint") : cat("step ", step);
}

// Loads the checkpoint in `dir` (one holding metadata.json).
LoadResult load_dir(State& state, const std::string& dir, const LoadOptions& options) {
  Metadata metadata;
  const std::string metadata_path = dir + "/" + kMetadataFile;
  run_agreed([&] { metadata = Metadata::parse(read_whole_file(metadata_path), metadata_path); });
  require_same_on_every_rank(metadata.step, cat("the step saved in ", metadata_path),
                             step_words);
  return load_from_metadata(state, metadata, dir, cat("checkpoint ", dir), "", options.strict);
}

}  // namespace

LoadResult load(State& state, const std::string& path, const LoadOptions& options) {
  namespace fs = std::filesystem;
  // Not following a link: load refuses one there, naming it, rather than
  // taking an older checkpoint instead.
  bool is_checkpoint = false;
  run_agreed([&] {
    std::error_code ec;
    is_checkpoint = fs::exists(fs::symlink_status(fs::path(path) / kMetadataFile, ec));
  });
  require_same_on_every_rank(is_checkpoint ? 1 : 0,
                             cat("whether '", path, "' is a checkpoint (holds ", kMetadataFile,
                                 ") or a root"),
                             [](int64_t v) { return std::string(v ? "a checkpoint" : "a root"); });
  if (is_checkpoint) return load_dir(state, path, options);

  // A root: its complete checkpoints, newest first. Each rank lists them
  // itself, so before each try the ranks agree on the step they try (and
  // on there being none left): a rank that sees other files refuses on
  // every rank instead of loading another step or waiting alone.
  std::vector<CheckpointDir> candidates;
  run_agreed([&] {
    for (CheckpointDir& c : complete_checkpoints(path)) {
      if (!options.newest_step || c.step <= *options.newest_step) candidates.push_back(c);
    }
  });
  std::vector<std::string> skipped;
  for (size_t i = 0;; ++i) {
    const int64_t step = i < candidates.size() ? candidates[i].step : -1;
    require_same_on_every_rank(step, cat("the newest checkpoint under '", path, "'",
                                         i == 0 ? "" : " that was not skipped"),
                               step_words);
    if (step < 0) {
      if (skipped.empty()) {
        throw CheckpointError(cat("checkpoint::load: '", path,
                                  "' holds no complete checkpoint (no ", kMetadataFile,
                                  " in it nor in a step-N directory under it)"));
      }
      std::string message = cat("checkpoint::load: '", path,
                                "' holds no intact checkpoint; every one failed its checks:");
      for (const std::string& s : skipped) message += "\n  " + s;
      throw CheckpointError(message);
    }
    const std::string& dir = candidates[i].path;
    try {
      LoadResult result = load_dir(state, dir, options);
      result.skipped = std::move(skipped);
      return result;
    } catch (const CheckpointError& e) {
      // Agreed: every rank is here with the same error. A corrupt newest
      // checkpoint must not fail every restart the same way: the one before
      // it is loaded instead (over whatever the failed try filled in).
      const bool last = i + 1 >= candidates.size();
      skipped.push_back(cat(dir, ": ", e.what()));
      if (last && skipped.size() == 1) throw;  // the only one: its own error
      if (!dist::is_initialized() || dist::get_rank() == 0) {
        std::cerr << "hp::checkpoint: skipping " << dir << ", which fails its checks: "
                  << e.what()
                  << (last ? "" : cat("; falling back to ", candidates[i + 1].path)) << std::endl;
      }
    }
  }
}

}  // namespace hp::checkpoint
