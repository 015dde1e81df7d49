// What the parity tests need to run a PyTorch reference script of
// tests/nn (gpt_reference.py, llama_reference.py): a scratch directory the
// two sides exchange tensors through, and the script's run.
#pragma once

#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <stdexcept>
#include <string>
#include <utility>

#ifndef HP_SOURCE_DIR
#error "HP_SOURCE_DIR (the repository root) must be defined by the build"
#endif
#ifndef HP_PYTHON
#error "HP_PYTHON (a Python with torch and numpy) must be defined by the build"
#endif

namespace hp::test {

// A fresh directory under the temp dir, removed with its files.
struct ReferenceDir {
  ReferenceDir() {
    std::string pattern =
        (std::filesystem::temp_directory_path() / "hp_parity_XXXXXX").string();
    if (mkdtemp(pattern.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
    path = pattern;
  }
  ~ReferenceDir() { std::filesystem::remove_all(path); }
  ReferenceDir(const ReferenceDir&) = delete;
  ReferenceDir& operator=(const ReferenceDir&) = delete;
  std::string path;
};

// Runs `HP_PYTHON tests/nn/<script> <dir>`; its exit status and its stdout
// and stderr together.
inline std::pair<int, std::string> run_reference(const std::string& script,
                                                 const std::string& dir) {
  const std::string command = std::string(HP_PYTHON) + " " + HP_SOURCE_DIR + "/tests/nn/" +
                              script + " " + dir + " 2>&1";
  std::string output;
  FILE* pipe = popen(command.c_str(), "r");
  if (pipe == nullptr) return {-1, "popen failed"};
  std::array<char, 4096> buffer;
  while (size_t n = fread(buffer.data(), 1, buffer.size(), pipe)) output.append(buffer.data(), n);
  const int status = pclose(pipe);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, output};
}

}  // namespace hp::test
