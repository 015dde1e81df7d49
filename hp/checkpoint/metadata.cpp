#include "hp/checkpoint/metadata.h"

#include <nlohmann/json.hpp>

#include <ATen/ATen.h>

#include "hp/checkpoint/crc32c.h"
#include "hp/checkpoint/errors.h"
#include "hp/checkpoint/safetensors.h"
#include "hp/util/format.h"

namespace hp::checkpoint {
namespace {

using Json = nlohmann::ordered_json;

constexpr const char* kFormat = "hp-checkpoint";
constexpr int64_t kVersion = 1;

uint32_t checksum_of(const Json& body) {
  const std::string text = body.dump();
  return crc32c(0, text.data(), text.size());
}

// Reads the fields of one parsed metadata file, raising with its path.
class Reader {
 public:
  explicit Reader(std::string path) : path_(std::move(path)) {}

  [[noreturn]] void fail(const std::string& what) const {
    throw CheckpointError(cat("checkpoint metadata ", path_, ": ", what));
  }

  const Json& field(const Json& object, const char* name, const std::string& where) const {
    if (!object.is_object() || !object.contains(name)) {
      fail(cat(where, " has no \"", name, "\""));
    }
    return object[name];
  }
  int64_t integer(const Json& object, const char* name, const std::string& where) const {
    const Json& v = field(object, name, where);
    if (!v.is_number_integer()) fail(cat(where, ": \"", name, "\" must be an integer, got ", v.dump()));
    return v.get<int64_t>();
  }
  uint64_t unsigned_integer(const Json& object, const char* name, const std::string& where) const {
    const Json& v = field(object, name, where);
    if (!v.is_number_unsigned()) {
      fail(cat(where, ": \"", name, "\" must be a non-negative integer, got ", v.dump()));
    }
    return v.get<uint64_t>();
  }
  std::optional<uint32_t> crc(const Json& object, const char* name, const std::string& where) const {
    if (!object.contains(name)) return std::nullopt;
    uint64_t v = unsigned_integer(object, name, where);
    if (v > 0xffffffffu) fail(cat(where, ": \"", name, "\" ", v, " is not a 32-bit checksum"));
    return static_cast<uint32_t>(v);
  }
  std::string text(const Json& object, const char* name, const std::string& where) const {
    const Json& v = field(object, name, where);
    if (!v.is_string()) fail(cat(where, ": \"", name, "\" must be a string, got ", v.dump()));
    return v.get<std::string>();
  }
  std::vector<int64_t> dims(const Json& object, const char* name, const std::string& where) const {
    const Json& v = field(object, name, where);
    if (!v.is_array()) fail(cat(where, ": \"", name, "\" must be an array, got ", v.dump()));
    std::vector<int64_t> out;
    for (const Json& d : v) {
      if (!d.is_number_unsigned() || d.get<uint64_t>() > static_cast<uint64_t>(INT64_MAX)) {
        fail(cat(where, ": \"", name, "\" must hold non-negative integers, got ", v.dump()));
      }
      out.push_back(d.get<int64_t>());
    }
    return out;
  }

 private:
  std::string path_;
};

int64_t numel_of(const std::vector<int64_t>& sizes) {
  int64_t n = 1;
  for (int64_t s : sizes) n *= s;
  return n;
}

bool boxes_overlap(const ChunkRecord& a, const ChunkRecord& b) {
  for (size_t d = 0; d < a.offsets.size(); ++d) {
    if (a.offsets[d] + a.sizes[d] <= b.offsets[d] || b.offsets[d] + b.sizes[d] <= a.offsets[d]) {
      return false;
    }
  }
  return true;
}

}  // namespace

const TensorRecord* Metadata::find(const std::string& key) const {
  for (const auto& [name, record] : tensors) {
    if (name == key) return &record;
  }
  return nullptr;
}

std::string Metadata::to_json() const {
  Json body = Json::object();
  body["format"] = kFormat;
  body["version"] = kVersion;
  body["step"] = step;
  body["world_size"] = world_size;
  Json files_json = Json::object();
  for (const auto& [name, file] : files) {
    Json f = {{"bytes", file.bytes}, {"header_bytes", file.header_bytes}};
    if (file.header_crc32c) f["header_crc32c"] = *file.header_crc32c;
    files_json[name] = f;
  }
  body["files"] = files_json;
  Json tensors_json = Json::object();
  for (const auto& [key, t] : tensors) {
    Json chunks = Json::array();
    for (const ChunkRecord& c : t.chunks) {
      Json cj = {{"offsets", c.offsets},         {"sizes", c.sizes}, {"file", c.file},
                 {"byte_offset", c.byte_offset}, {"bytes", c.bytes}};
      if (c.crc32c) cj["crc32c"] = *c.crc32c;
      chunks.push_back(cj);
    }
    tensors_json[key] = {
        {"dtype", t.dtype}, {"shape", t.shape}, {"layout", t.layout}, {"chunks", chunks}};
  }
  body["tensors"] = tensors_json;
  body["crc32c"] = checksum_of(body);
  return body.dump(1) + "\n";
}

Metadata Metadata::parse(const std::string& text, const std::string& path) {
  Reader r(path);
  Json body;
  try {
    body = Json::parse(text);
  } catch (const Json::parse_error& e) {
    r.fail(cat("not valid JSON (truncated or corrupt): ", e.what()));
  }
  if (!body.is_object()) r.fail("must hold a JSON object");
  const std::optional<uint32_t> stored = r.crc(body, "crc32c", "the file");
  if (!stored) r.fail("has no \"crc32c\"");
  body.erase("crc32c");
  if (checksum_of(body) != *stored) {
    r.fail(cat("checksum mismatch (stored ", *stored, ", computed ", checksum_of(body),
               "): the file is corrupt"));
  }
  if (r.text(body, "format", "the file") != kFormat) {
    r.fail(cat("\"format\" is ", body["format"].dump(), ", expected \"", kFormat, "\""));
  }
  if (r.integer(body, "version", "the file") != kVersion) {
    r.fail(cat("\"version\" ", body["version"].dump(), " is not supported (this build reads ",
               kVersion, ")"));
  }
  Metadata m;
  m.step = r.integer(body, "step", "the file");
  m.world_size = r.integer(body, "world_size", "the file");
  const Json& files = r.field(body, "files", "the file");
  if (!files.is_object()) r.fail("\"files\" must be an object");
  for (const auto& [name, f] : files.items()) {
    const std::string where = cat("file '", name, "'");
    if (name.empty() || name.find('/') != std::string::npos || name[0] == '.') {
      r.fail(cat(where, ": a file name must be a plain name inside the checkpoint"));
    }
    FileRecord record;
    record.bytes = r.unsigned_integer(f, "bytes", where);
    record.header_bytes = r.unsigned_integer(f, "header_bytes", where);
    record.header_crc32c = r.crc(f, "header_crc32c", where);
    if (record.header_bytes > record.bytes) r.fail(cat(where, ": header_bytes exceed bytes"));
    m.files[name] = record;
  }
  const Json& tensors = r.field(body, "tensors", "the file");
  if (!tensors.is_object()) r.fail("\"tensors\" must be an object");
  for (const auto& [key, t] : tensors.items()) {
    const std::string where = cat("tensor '", key, "'");
    TensorRecord record;
    record.dtype = r.text(t, "dtype", where);
    const std::optional<at::ScalarType> dtype = safetensors_dtype(record.dtype);
    if (!dtype) r.fail(cat(where, ": unknown dtype \"", record.dtype, "\""));
    record.shape = r.dims(t, "shape", where);
    record.layout = t.contains("layout") ? r.text(t, "layout", where) : std::string();
    const Json& chunks = r.field(t, "chunks", where);
    if (!chunks.is_array()) r.fail(cat(where, ": \"chunks\" must be an array"));
    int64_t covered = 0;
    for (const Json& c : chunks) {
      ChunkRecord chunk;
      chunk.offsets = r.dims(c, "offsets", where);
      chunk.sizes = r.dims(c, "sizes", where);
      chunk.file = r.text(c, "file", where);
      chunk.byte_offset = r.unsigned_integer(c, "byte_offset", where);
      chunk.bytes = r.unsigned_integer(c, "bytes", where);
      chunk.crc32c = r.crc(c, "crc32c", where);
      if (chunk.offsets.size() != record.shape.size() || chunk.sizes.size() != record.shape.size()) {
        r.fail(cat(where, ": a chunk's offsets ", to_string(chunk.offsets), " and sizes ",
                   to_string(chunk.sizes), " need one entry per dim of shape ",
                   to_string(record.shape)));
      }
      for (size_t d = 0; d < record.shape.size(); ++d) {
        if (chunk.offsets[d] + chunk.sizes[d] > record.shape[d]) {
          r.fail(cat(where, ": chunk at ", to_string(chunk.offsets), " of sizes ",
                     to_string(chunk.sizes), " lies outside shape ", to_string(record.shape)));
        }
      }
      const uint64_t expected =
          static_cast<uint64_t>(numel_of(chunk.sizes)) * at::elementSize(*dtype);
      if (chunk.bytes != expected) {
        r.fail(cat(where, ": chunk at ", to_string(chunk.offsets), " has ", chunk.bytes,
                   " bytes, its sizes need ", expected));
      }
      auto file = m.files.find(chunk.file);
      if (file == m.files.end()) {
        r.fail(cat(where, ": chunk in '", chunk.file, "', which \"files\" does not list"));
      }
      if (chunk.byte_offset < file->second.header_bytes ||
          chunk.byte_offset + chunk.bytes > file->second.bytes) {
        r.fail(cat(where, ": chunk bytes [", chunk.byte_offset, ", ",
                   chunk.byte_offset + chunk.bytes, ") lie outside the data of '", chunk.file,
                   "'"));
      }
      for (const ChunkRecord& other : record.chunks) {
        if (boxes_overlap(chunk, other)) {
          r.fail(cat(where, ": chunks at ", to_string(chunk.offsets), " and ",
                     to_string(other.offsets), " overlap"));
        }
      }
      covered += numel_of(chunk.sizes);
      record.chunks.push_back(std::move(chunk));
    }
    if (covered != numel_of(record.shape)) {
      r.fail(cat(where, ": its chunks cover ", covered, " of its ", numel_of(record.shape),
                 " elements"));
    }
    m.tensors.emplace_back(key, std::move(record));
  }
  return m;
}

}  // namespace hp::checkpoint
