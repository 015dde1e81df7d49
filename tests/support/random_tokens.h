// Token ids drawn from a fixed seed, for tests that feed a language model.
#pragma once

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <cstdint>
#include <vector>

namespace hp::test {

// A tensor of `shape` with ids uniform in [0, vocab), the same for a seed on
// every run and rank.
inline at::Tensor random_tokens(std::vector<int64_t> shape, int64_t vocab, uint64_t seed) {
  auto gen = at::detail::createCPUGenerator(seed);
  return at::randint(vocab, shape, gen, at::kLong);
}

}  // namespace hp::test
