// Reading and writing the safetensors format
// (https://github.com/huggingface/safetensors), so that checkpoints are
// readable by Python's `safetensors` package and PyTorch (C3 in docs/features.md).
//
// A file is an 8-byte little-endian header length N, N bytes of JSON
//   {"__metadata__": {"k": "v"},
//    "name": {"dtype": "F32", "shape": [2, 3], "data_offsets": [begin, end]}, ...}
// padded with spaces, then the data: each tensor row-major, little-endian and
// contiguous, at offsets relative to the end of the header. The ranges tile
// the data exactly (no gap, no overlap, nothing after the last), as the
// Python package demands. Supported dtypes: F64 F32 F16 BF16 I64 I32 I16 I8
// U8 BOOL.
#pragma once

#include <ATen/core/Tensor.h>

#include <map>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace hp::checkpoint {

// A file that cannot be read or written, or whose contents break the format.
// The message names the file, the tensor where there is one, and the fault.
class SafetensorsError : public std::runtime_error {
 public:
  explicit SafetensorsError(const std::string& what) : std::runtime_error(what) {}
};

struct SafetensorsFile {
  std::vector<std::pair<std::string, at::Tensor>> tensors;  // in file order (by offset)
  std::map<std::string, std::string> metadata;
};

// What a tensor will be, announced before its data.
struct SafetensorsSpec {
  std::string name;
  at::ScalarType dtype;
  std::vector<int64_t> shape;
};

// Writes a file tensor by tensor, so that a caller never holds more than
// one tensor of it (a consolidated export gathers one at a time). The
// header comes from the specs; write() must then get tensors of exactly those
// dtypes and shapes, in order, and commit() makes the file appear at `path`
// (fsync, rename, fsync of the directory). Destroyed without commit(), or
// after an error, the writer removes its temporary file and `path` is left
// as it was. Argument errors raise hp::ArgumentError before the disk is touched.
class SafetensorsWriter {
 public:
  SafetensorsWriter(const std::string& path, const std::vector<SafetensorsSpec>& tensors,
                    const std::map<std::string, std::string>& metadata = {});
  ~SafetensorsWriter();
  SafetensorsWriter(const SafetensorsWriter&) = delete;
  SafetensorsWriter& operator=(const SafetensorsWriter&) = delete;

  void write(const at::Tensor& tensor);
  void commit();
  // Where the data section starts (8 + the header's length).
  uint64_t data_start() const { return data_start_; }

 private:
  void abandon();

  std::string path_;
  std::string temp_;
  int fd_ = -1;
  std::vector<SafetensorsSpec> expected_;
  size_t written_ = 0;
  uint64_t data_start_ = 0;
};

// Writes `tensors` in the given order, each as a contiguous CPU copy, with
// the data starting 8-byte aligned. Atomic: the data goes to a temporary file
// in the same directory, which is fsynced and renamed over `path` (then the
// directory is fsynced), so a crash or an error leaves either the old file or
// the new one, never a mix, and no temporary behind.
// Raises hp::ArgumentError for empty, duplicate or reserved ("__metadata__")
// names, undefined tensors and unsupported dtypes, before touching the disk;
// SafetensorsError for I/O failures.
void write_safetensors(const std::string& path,
                       const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                       const std::map<std::string, std::string>& metadata = {});

// The safetensors name of a dtype ("F32") and back; unsupported ones give
// nullopt.
std::optional<std::string> safetensors_dtype_name(at::ScalarType type);
std::optional<at::ScalarType> safetensors_dtype(const std::string& name);

// Where each tensor of a file lies, from its header alone (the data is not
// read): what a reader needs to fetch only some tensors, or a checkpoint's
// metadata to record byte offsets.
struct SafetensorsEntry {
  std::string name;
  at::ScalarType dtype;
  std::vector<int64_t> shape;
  uint64_t offset;  // of the first byte, from the start of the file
  uint64_t bytes;
};
struct SafetensorsIndex {
  std::vector<SafetensorsEntry> entries;  // in file order (by offset)
  std::map<std::string, std::string> metadata;
  uint64_t data_start = 0;  // 8 + the header's length: where the data begins
  uint64_t file_size = 0;
};

// Reads and checks the header as read_safetensors does (every check that
// does not need the data, including that the ranges tile the rest of the
// file exactly), raising SafetensorsError naming the file.
SafetensorsIndex read_safetensors_index(const std::string& path);

// Reads the whole file into CPU tensors. Raises SafetensorsError when the
// file is missing or unreadable, or breaks the format: truncated header,
// header longer than the file, bad JSON, unknown dtype, a shape whose bytes
// differ from its data_offsets, ranges that overlap, leave gaps or do not end
// at the end of the file; or passes a limit of read_limits.h (a header over
// 100 MB, JSON nested deeper than 64, a shape beyond INT64_MAX bytes). Both
// readers follow a link at `path` but read only a regular file (a FIFO is
// refused, never waited on); every check runs before a tensor is allocated.
SafetensorsFile read_safetensors(const std::string& path);

}  // namespace hp::checkpoint
