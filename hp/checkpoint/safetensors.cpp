#include "hp/checkpoint/safetensors.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <set>

#include "hp/checkpoint/file_io.h"
#include "hp/checkpoint/read_limits.h"
#include "hp/util/error.h"
#include "hp/util/format.h"

// Tensor bytes go to and from the file as they lie in memory.
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "safetensors stores little-endian data; this host is big-endian");

namespace hp::checkpoint {
namespace {

using Json = nlohmann::ordered_json;  // keeps the header's order: ties at one offset stay put

struct DtypeInfo {
  const char* name;
  at::ScalarType type;
};

constexpr DtypeInfo kDtypes[] = {
    {"F64", at::kDouble}, {"F32", at::kFloat}, {"F16", at::kHalf},  {"BF16", at::kBFloat16},
    {"I64", at::kLong},   {"I32", at::kInt},   {"I16", at::kShort}, {"I8", at::kChar},
    {"U8", at::kByte},    {"BOOL", at::kBool},
};

std::string supported_names() {
  std::vector<std::string> names;
  for (const auto& d : kDtypes) names.push_back(d.name);
  return to_string(names);
}

const DtypeInfo* dtype_by_name(const std::string& name) {
  for (const auto& d : kDtypes) {
    if (name == d.name) return &d;
  }
  return nullptr;
}

const DtypeInfo* dtype_by_type(at::ScalarType type) {
  for (const auto& d : kDtypes) {
    if (type == d.type) return &d;
  }
  return nullptr;
}

[[noreturn]] void fail(const std::string& path, const std::string& what) {
  throw SafetensorsError(cat("safetensors file ", path, ": ", what));
}

[[noreturn]] void fail_tensor(const std::string& path, const std::string& name,
                              const std::string& what) {
  throw SafetensorsError(cat("tensor '", name, "' in ", path, ": ", what));
}

// ---- reading ---------------------------------------------------------------

struct Entry {
  std::string name;
  const DtypeInfo* dtype;
  std::vector<int64_t> shape;
  uint64_t begin, end;
};

uint64_t unsigned_field(const Json& value, const std::string& path, const std::string& name,
                        const char* field) {
  if (!value.is_number_unsigned()) {
    fail_tensor(path, name,
                cat(field, " must hold non-negative integers but has ", json_excerpt(value)));
  }
  return value.get<uint64_t>();
}

Entry parse_entry(const std::string& name, const Json& info, const std::string& path) {
  if (!info.is_object()) {
    fail_tensor(path, name, cat("entry must be an object but is ", json_excerpt(info)));
  }
  for (const char* field : {"dtype", "shape", "data_offsets"}) {
    if (!info.contains(field)) fail_tensor(path, name, cat("entry has no \"", field, "\""));
  }
  Entry e;
  e.name = name;
  const Json& dtype = info["dtype"];
  if (!dtype.is_string()) {
    fail_tensor(path, name, cat("dtype must be a string but is ", json_excerpt(dtype)));
  }
  e.dtype = dtype_by_name(dtype.get<std::string>());
  if (e.dtype == nullptr) {
    fail_tensor(path, name,
                cat("unknown dtype ", json_excerpt(dtype), "; supported: ", supported_names()));
  }
  const Json& shape = info["shape"];
  if (!shape.is_array()) {
    fail_tensor(path, name, cat("shape must be an array but is ", json_excerpt(shape)));
  }
  if (shape.size() > kMaxTensorDims) {
    fail_tensor(path, name, cat("shape has ", shape.size(), " dims, more than the ",
                                kMaxTensorDims, " a tensor may have"));
  }
  for (const Json& d : shape) {
    const uint64_t size = unsigned_field(d, path, name, "shape");
    if (size > static_cast<uint64_t>(INT64_MAX)) {
      fail_tensor(path, name, cat("shape ", json_excerpt(shape), " has a dim beyond INT64_MAX"));
    }
    e.shape.push_back(static_cast<int64_t>(size));
  }
  // Checked with a 0 dim counted as 1: torch computes the strides (and
  // numel) of an empty tensor too, and they must not overflow.
  const std::optional<uint64_t> checked =
      checked_tensor_bytes(e.shape, at::elementSize(e.dtype->type));
  if (!checked) {
    fail_tensor(path, name,
                cat("shape ", json_excerpt(shape), " of ", e.dtype->name,
                    " is too large: its dims (0 counted as 1) times the element size pass "
                    "INT64_MAX bytes"));
  }
  const uint64_t bytes = *checked;
  const Json& offsets = info["data_offsets"];
  if (!offsets.is_array() || offsets.size() != 2) {
    fail_tensor(path, name,
                cat("data_offsets must be [begin, end] but is ", json_excerpt(offsets)));
  }
  e.begin = unsigned_field(offsets[0], path, name, "data_offsets");
  e.end = unsigned_field(offsets[1], path, name, "data_offsets");
  if (e.end < e.begin) {
    fail_tensor(path, name, cat("data_offsets [", e.begin, ", ", e.end, "] end before they begin"));
  }
  if (e.end - e.begin != bytes) {
    fail_tensor(path, name,
                cat("shape ", to_string(e.shape), " of ", e.dtype->name, " needs ", bytes,
                    " bytes but data_offsets [", e.begin, ", ", e.end, "] give ",
                    e.end - e.begin));
  }
  return e;
}

// Parses the header, rejecting a name that appears twice (a JSON parser
// would silently keep one of them).
Json parse_header(const std::string& text, const std::string& path) {
  // nlohmann's dump() recurses, and messages dump values: the nesting is
  // bounded before the parser builds anything.
  if (const std::optional<size_t> at = json_too_deep(text, kMaxJsonDepth)) {
    fail(path, cat("header nests arrays and objects deeper than ", kMaxJsonDepth,
                   " levels (at byte ", 8 + *at, " of the file); a safetensors header nests 3"));
  }
  std::set<std::string> keys;
  std::string duplicate;
  auto on_event = [&](int depth, Json::parse_event_t event, Json& parsed) {
    if (depth == 1 && event == Json::parse_event_t::key && duplicate.empty() &&
        !keys.insert(parsed.get<std::string>()).second) {
      duplicate = parsed.get<std::string>();
    }
    return true;
  };
  Json header;
  try {
    header = Json::parse(text, on_event);
  } catch (const Json::exception& e) {
    // parse_error, or out_of_range for a number beyond a double ("1e400").
    fail(path, cat("header is not valid JSON: ", e.what()));
  }
  if (!duplicate.empty()) fail(path, cat("header names '", duplicate, "' twice"));
  if (!header.is_object()) fail(path, cat("header must be a JSON object but is a ", header.type_name()));
  return header;
}

std::map<std::string, std::string> parse_metadata(const Json& value, const std::string& path) {
  if (!value.is_object()) {
    fail(path, cat("__metadata__ must be an object but is ", json_excerpt(value)));
  }
  std::map<std::string, std::string> metadata;
  for (const auto& [key, v] : value.items()) {
    if (!v.is_string()) {
      fail(path, cat("__metadata__ values must be strings but '", key, "' is ", json_excerpt(v)));
    }
    metadata[key] = v.get<std::string>();
  }
  return metadata;
}

// ---- writing ---------------------------------------------------------------

std::string temp_path_for(const std::string& path) {
  static std::atomic<uint64_t> counter{0};
  return cat(path, ".tmp.", ::getpid(), ".", counter.fetch_add(1));
}


}  // namespace

SafetensorsWriter::SafetensorsWriter(const std::string& path,
                                     const std::vector<SafetensorsSpec>& tensors,
                                     const std::map<std::string, std::string>& metadata)
    : path_(path) {
  // Everything that can be wrong with the arguments is found before the
  // disk is touched.
  Json header = Json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::set<std::string> names;
  uint64_t offset = 0;
  for (const SafetensorsSpec& spec : tensors) {
    const std::string& name = spec.name;
    HP_CHECK_ARG(!name.empty(), "write_safetensors(", path, "): tensor names must be non-empty");
    HP_CHECK_ARG(name != "__metadata__", "write_safetensors(", path,
                 "): '__metadata__' is reserved for the metadata and cannot name a tensor");
    HP_CHECK_ARG(names.insert(name).second, "write_safetensors(", path, "): tensor name '", name,
                 "' is given twice; names must be unique");
    const DtypeInfo* dtype = dtype_by_type(spec.dtype);
    HP_CHECK_ARG(dtype != nullptr, "write_safetensors(", path, "): tensor '", name, "' has dtype ",
                 spec.dtype, ", which safetensors cannot hold; supported: ", supported_names());
    uint64_t bytes = at::elementSize(spec.dtype);
    for (int64_t d : spec.shape) {
      HP_CHECK_ARG(d >= 0, "write_safetensors(", path, "): tensor '", name, "' has shape ",
                   to_string(spec.shape), " with a negative size");
      bytes *= static_cast<uint64_t>(d);
    }
    header[name] = {{"dtype", dtype->name},
                    {"shape", spec.shape},
                    {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
    expected_.push_back(spec);
  }
  std::string text;
  try {
    text = header.dump();
  } catch (const Json::type_error& e) {
    throw_argument_error(cat("write_safetensors(", path,
                             "): tensor names and metadata must be valid UTF-8: ", e.what()));
  }
  // Pad with spaces so that the data starts 8-byte aligned, as the Python
  // package does, which lets readers map tensors straight from the file.
  text.append((8 - text.size() % 8) % 8, ' ');

  temp_ = temp_path_for(path);
  fd_ = ::open(temp_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
  if (fd_ < 0) fail(path, cat("cannot create '", temp_, "': ", errno_text()));
  try {
    unsigned char length[8];
    for (int i = 0; i < 8; ++i) length[i] = static_cast<unsigned char>(text.size() >> (8 * i));
    write_all(fd_, length, sizeof(length), temp_);
    write_all(fd_, text.data(), text.size(), temp_);
  } catch (...) {
    abandon();
    throw;
  }
  data_start_ = 8 + text.size();
}

SafetensorsWriter::~SafetensorsWriter() { abandon(); }

void SafetensorsWriter::abandon() {
  if (fd_ >= 0) {
    ::close(fd_);
    fd_ = -1;
  }
  if (!temp_.empty()) {
    ::unlink(temp_.c_str());
    temp_.clear();
  }
}

void SafetensorsWriter::write(const at::Tensor& tensor) {
  HP_CHECK_ARG(fd_ >= 0, "write_safetensors(", path_, "): the writer is closed");
  HP_CHECK_ARG(written_ < expected_.size(), "write_safetensors(", path_, "): ", expected_.size(),
               " tensors were announced and all are written");
  const SafetensorsSpec& spec = expected_[written_];
  HP_CHECK_ARG(tensor.defined(), "write_safetensors(", path_, "): tensor '", spec.name,
               "' is undefined");
  HP_CHECK_ARG(tensor.scalar_type() == spec.dtype && tensor.sizes().vec() == spec.shape,
               "write_safetensors(", path_, "): tensor '", spec.name, "' was announced as ",
               spec.dtype, " ", to_string(spec.shape), " but is ", tensor.scalar_type(), " ",
               to_string(tensor.sizes().vec()));
  at::Tensor t = tensor.detach().to(at::kCPU).contiguous();
  try {
    write_all(fd_, t.data_ptr(), t.nbytes(), temp_);
  } catch (...) {
    abandon();
    throw;
  }
  ++written_;
}

void SafetensorsWriter::commit() {
  HP_CHECK_ARG(fd_ >= 0, "write_safetensors(", path_, "): the writer is closed");
  HP_CHECK_ARG(written_ == expected_.size(), "write_safetensors(", path_, "): ", written_, " of ",
               expected_.size(), " announced tensors were written");
  try {
    if (::fsync(fd_) != 0) fail(path_, cat("cannot fsync '", temp_, "': ", errno_text()));
    const int rc = ::close(fd_);
    fd_ = -1;
    if (rc != 0) fail(path_, cat("cannot close '", temp_, "': ", errno_text()));
    if (::rename(temp_.c_str(), path_.c_str()) != 0) {
      fail(path_, cat("cannot rename '", temp_, "' over it: ", errno_text()));
    }
    temp_.clear();
  } catch (...) {
    abandon();
    throw;
  }
  fsync_directory_of(path_);
}

void write_safetensors(const std::string& path,
                       const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  std::vector<SafetensorsSpec> specs;
  for (const auto& [name, tensor] : tensors) {
    HP_CHECK_ARG(tensor.defined(), "write_safetensors(", path, "): tensor '", name,
                 "' is undefined");
    specs.push_back({name, tensor.scalar_type(), tensor.sizes().vec()});
  }
  SafetensorsWriter writer(path, specs, metadata);
  for (const auto& entry : tensors) writer.write(entry.second);
  writer.commit();
}

std::optional<std::string> safetensors_dtype_name(at::ScalarType type) {
  const DtypeInfo* d = dtype_by_type(type);
  if (d == nullptr) return std::nullopt;
  return std::string(d->name);
}

std::optional<at::ScalarType> safetensors_dtype(const std::string& name) {
  const DtypeInfo* d = dtype_by_name(name);
  if (d == nullptr) return std::nullopt;
  return d->type;
}

namespace {

// The checked header of an open file, its entries sorted by offset.
struct ParsedHeader {
  std::vector<Entry> entries;
  std::map<std::string, std::string> metadata;
  uint64_t data_start = 0;
  uint64_t file_size = 0;
};

// A file the caller names: a link is followed (model caches are made of
// them), anything but a regular file is refused without blocking on it.
int open_safetensors(const std::string& path) {
  return open_for_reading(path, /*follow_links=*/true);
}

ParsedHeader parse_file_header(int fd, const std::string& path) {
  struct stat st;
  if (::fstat(fd, &st) != 0) fail(path, cat("cannot stat: ", errno_text()));
  if (!S_ISREG(st.st_mode)) fail(path, "not a regular file");
  const uint64_t file_size = static_cast<uint64_t>(st.st_size);

  if (file_size < 8) {
    fail(path, cat("truncated: ", file_size, " bytes, too short for the 8-byte header length"));
  }
  unsigned char length[8];
  read_exact(fd, length, 8, 0, path);
  uint64_t header_size = 0;
  for (int i = 7; i >= 0; --i) header_size = (header_size << 8) | length[i];
  if (header_size > file_size - 8) {
    fail(path, cat("header length ", header_size, " is larger than the ", file_size - 8,
                   " bytes that follow it (truncated or not a safetensors file)"));
  }
  if (header_size > kMaxSafetensorsHeaderBytes) {
    fail(path, cat("header length ", header_size, " is larger than the ",
                   kMaxSafetensorsHeaderBytes, " bytes a safetensors header may have"));
  }
  std::string text(header_size, '\0');
  read_exact(fd, text.data(), header_size, 8, path);
  const Json header = parse_header(text, path);

  ParsedHeader parsed;
  for (const auto& [name, info] : header.items()) {
    if (name == "__metadata__") {
      parsed.metadata = parse_metadata(info, path);
    } else {
      parsed.entries.push_back(parse_entry(name, info, path));
    }
  }
  std::vector<Entry>& entries = parsed.entries;

  // The ranges, in offset order, must tile the data section exactly.
  std::stable_sort(entries.begin(), entries.end(), [](const Entry& a, const Entry& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  const uint64_t data_size = file_size - 8 - header_size;
  uint64_t expected = 0;
  const Entry* previous = nullptr;
  for (const Entry& e : entries) {
    if (e.begin < expected) {
      fail_tensor(path, e.name,
                  cat("data_offsets [", e.begin, ", ", e.end, "] overlap those of '",
                      previous->name, "' [", previous->begin, ", ", previous->end, "]"));
    }
    if (e.begin > expected) {
      fail_tensor(path, e.name,
                  cat("data_offsets [", e.begin, ", ", e.end, "] leave bytes [", expected, ", ",
                      e.begin, ") of the data unused"));
    }
    expected = e.end;
    previous = &e;
  }
  if (expected != data_size) {
    fail(path, cat("the tensors' data_offsets end at byte ", expected, " but the data section has ",
                   data_size, " bytes"));
  }
  parsed.data_start = 8 + header_size;
  parsed.file_size = file_size;
  return parsed;
}

}  // namespace

SafetensorsIndex read_safetensors_index(const std::string& path) {
  Fd fd(open_safetensors(path));
  ParsedHeader parsed = parse_file_header(fd.get(), path);
  SafetensorsIndex index;
  for (const Entry& e : parsed.entries) {
    index.entries.push_back(
        {e.name, e.dtype->type, e.shape, parsed.data_start + e.begin, e.end - e.begin});
  }
  index.metadata = std::move(parsed.metadata);
  index.data_start = parsed.data_start;
  index.file_size = parsed.file_size;
  return index;
}

SafetensorsFile read_safetensors(const std::string& path) {
  Fd fd(open_safetensors(path));
  ParsedHeader parsed = parse_file_header(fd.get(), path);
  SafetensorsFile file;
  file.metadata = std::move(parsed.metadata);
  for (const Entry& e : parsed.entries) {
    // Bytes that are not 0 or 1 would make an invalid bool: read them as
    // bytes and convert, as numpy does.
    const bool is_bool = e.dtype->type == at::kBool;
    // The header's ranges tile the file, so this is at most the file's
    // size; a file larger than memory is still refused with its name.
    at::Tensor t;
    try {
      t = at::empty(e.shape, is_bool ? at::kByte : e.dtype->type);
    } catch (const std::bad_alloc&) {
      fail_tensor(path, e.name, cat("cannot allocate its ", e.end - e.begin, " bytes"));
    } catch (const c10::Error& error) {
      fail_tensor(path, e.name, cat("cannot allocate its ", e.end - e.begin,
                                    " bytes: ", exception_message(error)));
    }
    read_exact(fd.get(), t.data_ptr(), e.end - e.begin, parsed.data_start + e.begin, path);
    file.tensors.emplace_back(e.name, is_bool ? t.to(at::kBool) : t);
  }
  return file;
}

}  // namespace hp::checkpoint
