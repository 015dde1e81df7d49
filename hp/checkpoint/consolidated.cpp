#include "hp/checkpoint/consolidated.h"

#include <ATen/ATen.h>

#include <filesystem>
#include <memory>

#include "hp/checkpoint/agreement.h"
#include "hp/checkpoint/load_core.h"
#include "hp/checkpoint/metadata.h"
#include "hp/checkpoint/safetensors.h"
#include "hp/distributed/world.h"
#include "hp/util/error.h"

namespace hp::checkpoint {

uint64_t export_consolidated(const State& state, const std::string& path,
                             const std::string& prefix) {
  const bool writer = !dist::is_initialized() || dist::get_rank() == 0;
  std::vector<const StateEntry*> entries;
  std::vector<SafetensorsSpec> specs;
  for (const StateEntry& entry : state.entries()) {
    if (entry.key.compare(0, prefix.size(), prefix) != 0) continue;
    entries.push_back(&entry);
    specs.push_back({entry.key.substr(prefix.size()), entry.local.scalar_type(), entry.shape});
  }
  std::unique_ptr<SafetensorsWriter> file;
  run_agreed([&] {
    HP_CHECK_ARG(!entries.empty(), "export_consolidated(", path, "): no key of the state starts with '",
                 prefix, "'");
    for (const StateEntry* entry : entries) {
      HP_CHECK_ARG(entry->holders.empty(), "export_consolidated(", path, "): key '", entry->key,
                   "' is held by ranks ", to_string(entry->holders),
                   " only (a pipeline stage's); load the checkpoint into the whole model in one "
                   "process and export that");
    }
    if (writer) file = std::make_unique<SafetensorsWriter>(path, specs);
  });
  // A write that fails on rank 0 must not stop it from joining the other
  // ranks' gathers: the error waits for the end.
  std::string failure;
  for (const StateEntry* entry : entries) {
    at::Tensor whole = entry->layout.defined()
                           ? from_local(entry->local.detach(), entry->layout, {entry->shape})
                                 .full_tensor()
                           : entry->local.detach();
    if (!file || !failure.empty()) continue;
    try {
      file->write(whole);
    } catch (const std::exception& e) {
      failure = exception_message(e);
    }
  }
  run_agreed([&] {
    if (!failure.empty()) throw CheckpointError(failure);
    if (file) file->commit();
  });
  std::error_code ec;
  const auto bytes = std::filesystem::file_size(path, ec);
  return ec ? 0 : static_cast<uint64_t>(bytes);
}

LoadResult import_consolidated(State& state, const std::string& path, const std::string& prefix,
                               bool strict) {
  Metadata metadata;
  // The caller names this file, and a link is fine (model caches are made
  // of them): the load reads the file it leads to, since it opens the files
  // of `metadata` as a checkpoint's, without following links.
  std::filesystem::path file(path);
  std::error_code ec;
  if (std::filesystem::is_symlink(std::filesystem::symlink_status(file, ec))) {
    const std::filesystem::path target = std::filesystem::canonical(file, ec);
    if (!ec) file = target;
  }
  const std::string name = file.filename().string();
  run_agreed([&] {
    const SafetensorsIndex index = read_safetensors_index(file.string());
    metadata.files[name] = {index.file_size, index.data_start, std::nullopt};
    for (const SafetensorsEntry& e : index.entries) {
      TensorRecord record;
      record.dtype = *safetensors_dtype_name(e.dtype);
      record.shape = e.shape;
      if (e.bytes > 0) {
        record.chunks.push_back(
            {std::vector<int64_t>(e.shape.size(), 0), e.shape, name, e.offset, e.bytes, {}});
      }
      metadata.tensors.emplace_back(e.name, std::move(record));
    }
  });
  const std::string dir = file.has_parent_path() ? file.parent_path().string() : ".";
  return load_from_metadata(state, metadata, dir, cat("safetensors file ", path), prefix, strict);
}

}  // namespace hp::checkpoint
