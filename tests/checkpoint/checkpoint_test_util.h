// Shared by the sharded-checkpoint tests: a scratch directory every rank of
// a job agrees on, and tensors whose values say where they came from.
#pragma once

#include <ATen/ATen.h>

#include <cstdlib>
#include <filesystem>
#include <string>

#include "hp/distributed/collectives.h"
#include "hp/distributed/world.h"
#include "tests/support/tensor_checks.h"

namespace hp::test {

// A directory under the test temp dir with the same name on every rank
// (the job's rendezvous port tells jobs apart), removed by rank 0 when the
// object goes away, after every rank is done with it.
class SharedTempDir {
 public:
  explicit SharedTempDir(const std::string& name) {
    const char* base = std::getenv("TMPDIR");
    const char* port = std::getenv("MASTER_PORT");
    path_ = std::string(base ? base : "/tmp") + "/hp_ckpt_" + name + "_" +
            (port ? port : std::to_string(::getpid()));
    if (rank() == 0) {
      std::filesystem::remove_all(path_);
      std::filesystem::create_directories(path_);
    }
    sync();
  }
  ~SharedTempDir() {
    sync();
    if (rank() == 0) std::filesystem::remove_all(path_);
  }
  const std::string& path() const { return path_; }
  std::string operator/(const std::string& name) const { return path_ + "/" + name; }

  static void sync() {
    if (dist::is_initialized()) dist::barrier(*dist::world_group()).wait();
  }

 private:
  std::string path_;
};

// A global tensor of `shape` and `dtype` whose elements are distinct small
// integers offset by `salt` (exact in every dtype used here, bool aside).
inline at::Tensor numbered(const std::vector<int64_t>& shape, at::ScalarType dtype, int64_t salt) {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  at::Tensor t = at::arange(n, at::kLong).add(salt * 1000).reshape(shape);
  if (dtype == at::kBool) return t.remainder(3).eq(1);
  if (dtype == at::kBFloat16) return t.remainder(256).to(dtype);  // bf16 holds 8 bits exactly
  return t.to(dtype);
}

}  // namespace hp::test
