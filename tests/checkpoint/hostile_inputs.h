// Crafted checkpoint inputs shared by the hostile-file tests and the
// fuzz test's seed corpus: safetensors bytes from a header text, deep JSON,
// and a small valid metadata.json to break field by field.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>

#include "hp/checkpoint/crc32c.h"

namespace hp::test {

// A safetensors file: the header's length (little-endian), the header, then
// `data`.
inline std::string safetensors_bytes(const std::string& header, const std::string& data = "") {
  std::string out(8, '\0');
  uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>(n >> (8 * i));
  return out + header + data;
}

// `depth` nested arrays: "[[[]]]" for 3.
inline std::string nested(size_t depth) {
  return std::string(depth, '[') + std::string(depth, ']');
}

// The metadata of one float tensor "w" of shape [4] in one chunk of
// rank-00000.safetensors (a 72-byte header, then its 16 bytes), without
// its checksum.
inline nlohmann::ordered_json small_metadata() {
  using Json = nlohmann::ordered_json;
  Json body = Json::object();
  body["format"] = "hp-checkpoint";
  body["version"] = 1;
  body["step"] = 1;
  body["world_size"] = 1;
  body["files"] = {{"rank-00000.safetensors", {{"bytes", 88}, {"header_bytes", 72}}}};
  body["tensors"] = {
      {"w",
       {{"dtype", "F32"},
        {"shape", {4}},
        {"layout", ""},
        {"chunks",
         Json::array({{{"offsets", {0}},
                       {"sizes", {4}},
                       {"file", "rank-00000.safetensors"},
                       {"byte_offset", 72},
                       {"bytes", 16}}})}}}};
  return body;
}

// The text of `body` with the checksum metadata.json carries (the CRC-32C
// of the compact JSON without it, appended last), so that a parser checks
// every field after it.
inline std::string with_checksum(nlohmann::ordered_json body) {
  body.erase("crc32c");
  const std::string text = body.dump();
  body["crc32c"] = checkpoint::crc32c(0, text.data(), text.size());
  return body.dump(1) + "\n";
}

}  // namespace hp::test
