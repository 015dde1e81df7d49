// What the checkpoint readers accept from a file, and the checks that hold
// them to it (C8 in docs/features.md). A file is hostile input: every size,
// offset, shape and nesting depth it gives is checked against these limits,
// with arithmetic that cannot overflow, before anything is allocated or
// parsed on its word.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json_fwd.hpp>  // file_io.h includes this header: no parser for its users

namespace hp::checkpoint {

// A safetensors header: the reference implementation (Rust) refuses longer
// ones too, so no file another tool reads is refused here.
inline constexpr uint64_t kMaxSafetensorsHeaderBytes = 100'000'000;

// metadata.json is read whole. A chunk record takes about 250 bytes, so this
// holds some four million chunks (a thousand tensors saved by four thousand
// ranks), far beyond the jobs this library runs.
inline constexpr uint64_t kMaxMetadataBytes = uint64_t{1} << 30;

// Dims of a tensor: numpy 2 allows 64 (numpy 1, 32), so no file other
// tools read is refused, and a shape cannot make torch allocate sizes and
// strides by the million.
inline constexpr size_t kMaxTensorDims = 64;

// Nesting of arrays and objects in any JSON a reader parses. The formats
// nest 6 levels at most (metadata.json: object, "tensors", a tensor,
// "chunks", a chunk, "offsets"); the limit keeps anything walking the tree
// recursively (nlohmann's dump()) far from the end of the stack.
inline constexpr int kMaxJsonDepth = 64;

// Where `text` nests arrays and objects deeper than `max_depth`: the byte
// offset of the first bracket past it, or nullopt. A linear scan that skips
// strings (and their escapes), cheap enough to run before every parse.
std::optional<size_t> json_too_deep(std::string_view text, int max_depth = kMaxJsonDepth);

// A JSON value for an error message, cut to `max_chars` ("..." marks the
// cut), so that a file cannot make a message as long as itself.
std::string json_excerpt(const nlohmann::ordered_json& value, size_t max_chars = 80);

// The bytes of a tensor of `shape` whose elements take `element_size`
// bytes, or nullopt when a dim is negative or the product of the dims (a 0
// counted as 1) times the element size passes INT64_MAX: then torch cannot
// describe the tensor (its numel or strides overflow), even when a 0 dim
// makes it empty.
std::optional<uint64_t> checked_tensor_bytes(const std::vector<int64_t>& shape,
                                             uint64_t element_size);

}  // namespace hp::checkpoint
