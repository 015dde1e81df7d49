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

// Reads the whole file into CPU tensors. Raises SafetensorsError when the
// file is missing or unreadable, or breaks the format: truncated header,
// header longer than the file, bad JSON, unknown dtype, a shape whose bytes
// differ from its data_offsets, ranges that overlap, leave gaps or do not end
// at the end of the file.
SafetensorsFile read_safetensors(const std::string& path);

}  // namespace hp::checkpoint
