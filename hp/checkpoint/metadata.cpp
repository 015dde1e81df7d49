#include "hp/checkpoint/metadata.h"

#include <nlohmann/json.hpp>

#include <ATen/ATen.h>

#include <algorithm>

#include "hp/checkpoint/crc32c.h"
#include "hp/checkpoint/errors.h"
#include "hp/checkpoint/read_limits.h"
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
    if (!v.is_number_integer() ||
        (v.is_number_unsigned() && v.get<uint64_t>() > static_cast<uint64_t>(INT64_MAX))) {
      fail(cat(where, ": \"", name, "\" must be a 64-bit integer, got ", json_excerpt(v)));
    }
    return v.get<int64_t>();
  }
  uint64_t unsigned_integer(const Json& object, const char* name, const std::string& where) const {
    const Json& v = field(object, name, where);
    if (!v.is_number_unsigned()) {
      fail(cat(where, ": \"", name, "\" must be a non-negative integer, got ", json_excerpt(v)));
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
    if (!v.is_string()) {
      fail(cat(where, ": \"", name, "\" must be a string, got ", json_excerpt(v)));
    }
    return v.get<std::string>();
  }
  std::vector<int64_t> dims(const Json& object, const char* name, const std::string& where) const {
    const Json& v = field(object, name, where);
    if (!v.is_array()) fail(cat(where, ": \"", name, "\" must be an array, got ", json_excerpt(v)));
    std::vector<int64_t> out;
    for (const Json& d : v) {
      if (!d.is_number_unsigned() || d.get<uint64_t>() > static_cast<uint64_t>(INT64_MAX)) {
        fail(cat(where, ": \"", name, "\" must hold integers from 0 to INT64_MAX, got ",
                 json_excerpt(v)));
      }
      out.push_back(d.get<int64_t>());
    }
    return out;
  }

 private:
  std::string path_;
};

// Elements of a box whose dims were checked (each inside a shape whose
// checked_tensor_bytes passed), so the product cannot overflow.
int64_t numel_of(const std::vector<int64_t>& sizes) {
  int64_t n = 1;
  for (int64_t s : sizes) n *= s;
  return n;
}

// Boxes inside one shape: offset + size never passes the shape's dim.
bool boxes_overlap(const ChunkRecord& a, const ChunkRecord& b) {
  for (size_t d = 0; d < a.offsets.size(); ++d) {
    if (a.offsets[d] + a.sizes[d] <= b.offsets[d] || b.offsets[d] + b.sizes[d] <= a.offsets[d]) {
      return false;
    }
  }
  return true;
}

// Chunks of one tensor checked pairwise only up to this many: beyond, the
// grid check below must decide (a file can list millions of chunks).
constexpr size_t kMaxChunksCheckedPairwise = 4096;

// Two of `chunks` (non-empty boxes inside one shape of `ndim` dims) that
// overlap, or nullopt; std::nullopt with `undecided` set when neither check
// below fits its budget. The boxes' edges cut every dim into intervals, the
// intervals into grid cells, and each box covers whole cells: boxes overlap
// exactly when a cell is covered twice. A saved layout makes a grid of about
// one cell per chunk, so cells are counted before any is marked, and a grid
// beyond 4 cells per chunk falls back to comparing pairs when they are few.
std::optional<std::pair<size_t, size_t>> find_overlap(
    const std::vector<const ChunkRecord*>& chunks, size_t ndim, bool& undecided) {
  undecided = false;
  const size_t n = chunks.size();
  if (n < 2) return std::nullopt;
  std::vector<std::vector<int64_t>> cuts(ndim);
  uint64_t cells = 1;
  const uint64_t max_cells = 4 * static_cast<uint64_t>(n);
  bool grid_fits = true;
  for (size_t d = 0; d < ndim && grid_fits; ++d) {
    std::vector<int64_t>& c = cuts[d];
    c.reserve(2 * n);
    for (const ChunkRecord* chunk : chunks) {
      c.push_back(chunk->offsets[d]);
      c.push_back(chunk->offsets[d] + chunk->sizes[d]);
    }
    std::sort(c.begin(), c.end());
    c.erase(std::unique(c.begin(), c.end()), c.end());
    grid_fits = !__builtin_mul_overflow(cells, c.size() - 1, &cells) && cells <= max_cells;
  }
  if (grid_fits) {
    std::vector<uint64_t> stride(ndim, 1);  // of the cells, row-major
    for (size_t d = ndim; d-- > 1;) stride[d - 1] = stride[d] * (cuts[d].size() - 1);
    std::vector<bool> covered(cells, false);
    std::vector<size_t> lo(ndim), hi(ndim), index(ndim);
    for (size_t i = 0; i < n; ++i) {
      const ChunkRecord& chunk = *chunks[i];
      for (size_t d = 0; d < ndim; ++d) {
        const auto& c = cuts[d];
        auto position = [&c](int64_t edge) {
          return static_cast<size_t>(std::lower_bound(c.begin(), c.end(), edge) - c.begin());
        };
        lo[d] = position(chunk.offsets[d]);
        hi[d] = position(chunk.offsets[d] + chunk.sizes[d]);
        index[d] = lo[d];
      }
      // Every cell of the box, in odometer order (one for a 0-dim box).
      while (true) {
        uint64_t cell = 0;
        for (size_t d = 0; d < ndim; ++d) cell += index[d] * stride[d];
        if (covered[cell]) {
          for (size_t j = 0; j < i; ++j) {
            if (boxes_overlap(chunk, *chunks[j])) return std::make_pair(j, i);
          }
        }
        covered[cell] = true;
        size_t d = ndim;
        while (d > 0 && ++index[d - 1] == hi[d - 1]) {
          index[d - 1] = lo[d - 1];
          --d;
        }
        if (d == 0) break;
      }
    }
    return std::nullopt;
  }
  if (n > kMaxChunksCheckedPairwise) {
    undecided = true;
    return std::nullopt;
  }
  for (size_t i = 0; i < n; ++i) {
    for (size_t j = 0; j < i; ++j) {
      if (boxes_overlap(*chunks[i], *chunks[j])) return std::make_pair(j, i);
    }
  }
  return std::nullopt;
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
  if (text.size() > kMaxMetadataBytes) {
    r.fail(cat("has ", text.size(), " bytes, more than the ", kMaxMetadataBytes,
               " this reader accepts"));
  }
  // The checksum below dumps the parsed tree, and nlohmann's dump() recurses:
  // the nesting is bounded before anything is parsed.
  if (const std::optional<size_t> at = json_too_deep(text, kMaxJsonDepth)) {
    r.fail(cat("nests arrays and objects deeper than ", kMaxJsonDepth, " levels (at byte ", *at,
               "); the format nests 6"));
  }
  Json body;
  try {
    body = Json::parse(text);
  } catch (const Json::exception& e) {
    // parse_error, or out_of_range for a number beyond a double ("1e400").
    r.fail(cat("not valid JSON (truncated or corrupt): ", e.what()));
  }
  if (!body.is_object()) r.fail("must hold a JSON object");
  const std::optional<uint32_t> stored = r.crc(body, "crc32c", "the file");
  if (!stored) r.fail("has no \"crc32c\"");
  body.erase("crc32c");
  const uint32_t computed = checksum_of(body);
  if (computed != *stored) {
    r.fail(cat("checksum mismatch (stored ", *stored, ", computed ", computed,
               "): the file is corrupt"));
  }
  if (r.text(body, "format", "the file") != kFormat) {
    r.fail(cat("\"format\" is ", json_excerpt(body["format"]), ", expected \"", kFormat, "\""));
  }
  if (r.integer(body, "version", "the file") != kVersion) {
    r.fail(cat("\"version\" ", json_excerpt(body["version"]),
               " is not supported (this build reads ", kVersion, ")"));
  }
  Metadata m;
  m.step = r.integer(body, "step", "the file");
  if (m.step < 0) r.fail(cat("\"step\" ", m.step, " is negative; a save's step is >= 0"));
  m.world_size = r.integer(body, "world_size", "the file");
  if (m.world_size < 1) r.fail(cat("\"world_size\" ", m.world_size, " must be >= 1"));
  const Json& files = r.field(body, "files", "the file");
  if (!files.is_object()) r.fail("\"files\" must be an object");
  for (const auto& [name, f] : files.items()) {
    const std::string where = cat("file '", name, "'");
    // A plain name, so that dir + "/" + name stays inside the checkpoint
    // (a NUL would cut the name the kernel sees).
    if (name.empty() || name.find_first_of(std::string("/\0", 2)) != std::string::npos ||
        name[0] == '.') {
      r.fail(cat("file ", json_excerpt(Json(name)),
                 ": a file name must be a plain name inside the checkpoint"));
    }
    FileRecord record;
    record.bytes = r.unsigned_integer(f, "bytes", where);
    record.header_bytes = r.unsigned_integer(f, "header_bytes", where);
    record.header_crc32c = r.crc(f, "header_crc32c", where);
    if (record.header_bytes > record.bytes) r.fail(cat(where, ": header_bytes exceed bytes"));
    // A load reads the header whole to check it.
    if (record.header_bytes > 8 + kMaxSafetensorsHeaderBytes) {
      r.fail(cat(where, ": header_bytes ", record.header_bytes, " pass the ",
                 8 + kMaxSafetensorsHeaderBytes, " of the largest safetensors header"));
    }
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
    const uint64_t element = at::elementSize(*dtype);
    record.shape = r.dims(t, "shape", where);
    if (record.shape.size() > kMaxTensorDims) {
      r.fail(cat(where, ": shape has ", record.shape.size(), " dims, more than the ",
                 kMaxTensorDims, " a tensor may have"));
    }
    // Every chunk lies inside the shape, so this bounds all the arithmetic
    // on chunks below too.
    const std::optional<uint64_t> tensor_bytes = checked_tensor_bytes(record.shape, element);
    if (!tensor_bytes) {
      r.fail(cat(where, ": shape ", to_string(record.shape), " of ", record.dtype,
                 " is too large: its dims (0 counted as 1) times the element size pass "
                 "INT64_MAX bytes"));
    }
    record.layout = t.contains("layout") ? r.text(t, "layout", where) : std::string();
    const Json& chunks = r.field(t, "chunks", where);
    if (!chunks.is_array()) r.fail(cat(where, ": \"chunks\" must be an array"));
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
        // offset + size <= dim, written so that nothing overflows.
        if (chunk.offsets[d] > record.shape[d] ||
            chunk.sizes[d] > record.shape[d] - chunk.offsets[d]) {
          r.fail(cat(where, ": chunk at ", to_string(chunk.offsets), " of sizes ",
                     to_string(chunk.sizes), " lies outside shape ", to_string(record.shape)));
        }
      }
      const uint64_t expected = static_cast<uint64_t>(numel_of(chunk.sizes)) * element;
      if (chunk.bytes != expected) {
        r.fail(cat(where, ": chunk at ", to_string(chunk.offsets), " has ", chunk.bytes,
                   " bytes, its sizes need ", expected));
      }
      auto file = m.files.find(chunk.file);
      if (file == m.files.end()) {
        r.fail(cat(where, ": chunk in '", chunk.file, "', which \"files\" does not list"));
      }
      const FileRecord& in = file->second;
      if (chunk.byte_offset < in.header_bytes || chunk.byte_offset > in.bytes ||
          chunk.bytes > in.bytes - chunk.byte_offset) {
        r.fail(cat(where, ": chunk bytes at ", chunk.byte_offset, " (", chunk.bytes,
                   " of them) lie outside the data [", in.header_bytes, ", ", in.bytes, ") of '",
                   chunk.file, "'"));
      }
      record.chunks.push_back(std::move(chunk));
    }
    // An empty chunk holds no element, so it overlaps nothing.
    std::vector<const ChunkRecord*> boxes;
    for (const ChunkRecord& chunk : record.chunks) {
      if (numel_of(chunk.sizes) > 0) boxes.push_back(&chunk);
    }
    bool undecided = false;
    if (const auto pair = find_overlap(boxes, record.shape.size(), undecided)) {
      r.fail(cat(where, ": chunks at ", to_string(boxes[pair->second]->offsets), " and ",
                 to_string(boxes[pair->first]->offsets), " overlap"));
    }
    if (undecided) {
      r.fail(cat(where, ": ", boxes.size(), " chunks that do not form a grid; this reader checks "
                 "irregular layouts of at most ", kMaxChunksCheckedPairwise, " chunks"));
    }
    // Disjoint boxes inside the shape: the sum stays within its numel.
    int64_t covered = 0;
    for (const ChunkRecord* chunk : boxes) covered += numel_of(chunk->sizes);
    if (covered != numel_of(record.shape)) {
      r.fail(cat(where, ": its chunks cover ", covered, " of its ", numel_of(record.shape),
                 " elements"));
    }
    m.tensors.emplace_back(key, std::move(record));
  }
  return m;
}

}  // namespace hp::checkpoint
