// The token stream hp-train learns from (A1 in docs/features.md).
//
// By default Debian's `fortunes` text, byte by byte (vocabulary 256), so the
// main job needs no download and no tokenizer. Any other corpus comes as a
// file of raw little-endian uint16 token ids (`--data-file FILE --vocab V`),
// as tokenizers' export scripts commonly write them.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>

namespace hp::train {

struct Corpus {
  at::Tensor tokens;        // 1-D int64, every value in [0, vocab_size)
  int64_t vocab_size = 0;
  std::string description;  // where the tokens came from, for logs
};

constexpr const char* kFortunesDir = "/usr/share/games/fortunes";

// The plain-text fortune files of `dir` (names without an extension: not the
// .dat indexes nor the .u8 links, and no subdirectory such as off/),
// concatenated in byte-wise sorted name order, each byte one token.
// Throws std::runtime_error, naming the package to install, when `dir` is
// missing or holds no fortune file.
Corpus load_fortunes(const std::string& dir = kFortunesDir);

// Tokens stored as raw little-endian uint16. Throws hp::ArgumentError naming
// the file when it is missing, empty or of odd size, or when a token is not
// below `vocab_size` (with the first such position and value), and for a
// vocab_size outside [1, 65536].
Corpus load_token_file(const std::string& path, int64_t vocab_size);

}  // namespace hp::train
