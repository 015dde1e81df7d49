// The metadata file of a sharded checkpoint (C1 in docs/features.md):
// what every saved tensor is and where its bytes lie, so that a load on any
// mesh can find the chunks it needs without opening the other files.
//
// metadata.json, written by rank 0 after every rank's file is on disk:
//   {"format": "hp-checkpoint", "version": 1, "step": 100, "world_size": 4,
//    "files": {"rank-00001.safetensors": {"bytes": 4168, "header_bytes": 184,
//                                         "header_crc32c": 2913418820}, ...},
//    "tensors": {"model.wte.weight": {"dtype": "F32", "shape": [256, 128],
//                "layout": "Layout(mesh ['shard'] [4], [S(0)])",
//                "chunks": [{"offsets": [64, 0], "sizes": [64, 128],
//                            "file": "rank-00001.safetensors", "byte_offset": 184,
//                            "bytes": 32768, "crc32c": 123456789}, ...]}, ...},
//    "crc32c": <CRC-32C of this object's JSON without this field>}
// Each chunk is a box of the global tensor (offsets and sizes per dim),
// stored row-major and contiguous at byte_offset of its file (each rank's
// file is a valid safetensors file too). The chunks of a tensor tile it
// exactly. Every byte of every file is under a checksum: a file's header
// under header_crc32c, each chunk's data under its crc32c.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace hp::checkpoint {

struct ChunkRecord {
  std::vector<int64_t> offsets;
  std::vector<int64_t> sizes;
  std::string file;          // a name inside the checkpoint directory
  uint64_t byte_offset = 0;  // from the start of the file
  uint64_t bytes = 0;
  std::optional<uint32_t> crc32c;  // absent for files imported from elsewhere
};

struct TensorRecord {
  std::string dtype;  // safetensors' name: "F32", "I64", ...
  std::vector<int64_t> shape;
  std::string layout;  // how the saving job held it (for people reading the file)
  std::vector<ChunkRecord> chunks;
};

struct FileRecord {
  uint64_t bytes = 0;
  uint64_t header_bytes = 0;  // 8 + the safetensors header
  std::optional<uint32_t> header_crc32c;
};

struct Metadata {
  int64_t step = 0;
  int64_t world_size = 1;
  std::map<std::string, FileRecord> files;
  std::vector<std::pair<std::string, TensorRecord>> tensors;  // in the saved state's order

  const TensorRecord* find(const std::string& key) const;

  // The JSON text above, checksum included.
  std::string to_json() const;
  // Parses and checks the text of `path`: the checksum, the fields, every
  // chunk inside its tensor and of the right byte size, the chunks of each
  // tensor tiling it, every file named in "files", and the limits of
  // read_limits.h (size, nesting, arithmetic that would overflow), before
  // it parses. Raises CheckpointError naming `path` and what is wrong.
  static Metadata parse(const std::string& text, const std::string& path);
};

}  // namespace hp::checkpoint
