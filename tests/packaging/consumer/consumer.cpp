// Writes a tensor with the installed library's safetensors writer and reads
// it back: code of the package's static libraries (hp_checkpoint) running on
// the libtorch it finds, so a libtorch other than the one the package was
// built with fails to link or to run here. Exits non-zero on a mismatch.
#include <ATen/ops/arange.h>
#include <ATen/ops/equal.h>

#include <cstdio>
#include <string>

#include "hp/checkpoint/safetensors.h"

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: consumer FILE\n");
    return 2;
  }
  const std::string path = argv[1];
  const at::Tensor written = at::arange(12, at::kFloat).reshape({3, 4});
  hp::checkpoint::write_safetensors(path, {{"w", written}});
  const auto file = hp::checkpoint::read_safetensors(path);
  if (file.tensors.size() != 1 || file.tensors[0].first != "w" ||
      !at::equal(file.tensors[0].second, written)) {
    std::fprintf(stderr, "consumer: the tensor read back differs from the one written\n");
    return 1;
  }
  // The version the package's config found (consumer/CMakeLists.txt).
  std::printf("consumer: wrote and read back a tensor with libtorch %s\n",
              HP_CONSUMER_TORCH_VERSION);
  return 0;
}
