#include "tools/hp_train/corpus.h"

#include <ATen/ATen.h>
#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <stdexcept>
#include <system_error>
#include <vector>

#include "hp/util/error.h"
#include "hp/util/format.h"

namespace hp::train {
namespace {

namespace fs = std::filesystem;

std::string read_bytes(const std::string& path) {
  errno = 0;
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error(fmt::format("cannot open '{}': {}", path, std::strerror(errno)));
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad()) throw std::runtime_error(fmt::format("cannot read '{}'", path));
  return bytes;
}

}  // namespace

Corpus load_fortunes(const std::string& dir) {
  const std::string install = "install the 'fortunes' package: scripts/install-deps.sh";
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) {
    throw std::runtime_error(
        fmt::format("fortunes corpus: directory '{}' not found; {}", dir, install));
  }
  // The plain text is in the files without an extension: "x.dat" is the
  // index strfile builds and "x.u8" a link to x; off/ holds offensive ones.
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(dir)) {
    const std::string name = entry.path().filename().string();
    if (name.find('.') == std::string::npos && entry.is_regular_file()) names.push_back(name);
  }
  if (names.empty()) {
    throw std::runtime_error(
        fmt::format("fortunes corpus: '{}' holds no fortune files; {}", dir, install));
  }
  std::sort(names.begin(), names.end());  // byte-wise, independent of the locale

  std::string text;
  for (const std::string& name : names) text += read_bytes(dir + "/" + name);
  at::Tensor tokens = at::empty({static_cast<int64_t>(text.size())}, at::kLong);
  int64_t* out = tokens.data_ptr<int64_t>();
  for (size_t i = 0; i < text.size(); ++i) out[i] = static_cast<unsigned char>(text[i]);
  return {tokens, 256,
          fmt::format("fortunes ({}, {} files): {} byte tokens, vocab 256", dir, names.size(),
                      text.size())};
}

Corpus load_token_file(const std::string& path, int64_t vocab_size) {
  HP_CHECK_ARG(vocab_size >= 1 && vocab_size <= 65536, "--vocab must be in [1, 65536] for ",
               "uint16 tokens but got ", vocab_size);
  std::error_code ec;
  HP_CHECK_ARG(fs::is_regular_file(path, ec), "--data-file '", path,
               "' is not a readable file (expected raw little-endian uint16 tokens)");
  const std::string bytes = read_bytes(path);
  HP_CHECK_ARG(!bytes.empty(), "--data-file '", path, "' is empty");
  HP_CHECK_ARG(bytes.size() % 2 == 0, "--data-file '", path, "' has ", bytes.size(),
               " bytes, an odd number: it must hold little-endian uint16 tokens (2 bytes each)");

  const int64_t count = static_cast<int64_t>(bytes.size() / 2);
  at::Tensor tokens = at::empty({count}, at::kLong);
  int64_t* out = tokens.data_ptr<int64_t>();
  const auto* in = reinterpret_cast<const unsigned char*>(bytes.data());
  for (int64_t i = 0; i < count; ++i) {
    const int64_t token = in[2 * i] | (in[2 * i + 1] << 8);
    HP_CHECK_ARG(token < vocab_size, "--data-file '", path, "': token at position ", i, " is ",
                 token, ", not below --vocab ", vocab_size);
    out[i] = token;
  }
  return {tokens, vocab_size,
          fmt::format("{}: {} uint16 tokens, vocab {}", path, count, vocab_size)};
}

}  // namespace hp::train
