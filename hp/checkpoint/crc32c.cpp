#include "hp/checkpoint/crc32c.h"

#include <array>
#include <cstring>

#if defined(__x86_64__)
#include <nmmintrin.h>
#endif

namespace hp::checkpoint {
namespace {

constexpr uint32_t kPolynomial = 0x82f63b78;  // reflected Castagnoli

constexpr std::array<uint32_t, 256> make_table() {
  std::array<uint32_t, 256> table{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ kPolynomial : c >> 1;
    table[i] = c;
  }
  return table;
}

constexpr std::array<uint32_t, 256> kTable = make_table();

uint32_t crc32c_portable(uint32_t state, const unsigned char* p, size_t size) {
  while (size-- > 0) state = kTable[(state ^ *p++) & 0xff] ^ (state >> 8);
  return state;
}

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) uint32_t crc32c_sse42(uint32_t state, const unsigned char* p,
                                                        size_t size) {
  uint64_t s = state;
  while (size >= 8) {
    uint64_t word;
    std::memcpy(&word, p, 8);
    s = _mm_crc32_u64(s, word);
    p += 8;
    size -= 8;
  }
  auto s32 = static_cast<uint32_t>(s);
  while (size-- > 0) s32 = _mm_crc32_u8(s32, *p++);
  return s32;
}

const bool kHaveSse42 = __builtin_cpu_supports("sse4.2");
#endif

}  // namespace

uint32_t crc32c(uint32_t crc, const void* data, size_t size) {
  const auto* p = static_cast<const unsigned char*>(data);
  uint32_t state = ~crc;
#if defined(__x86_64__)
  if (kHaveSse42) return ~crc32c_sse42(state, p, size);
#endif
  return ~crc32c_portable(state, p, size);
}

}  // namespace hp::checkpoint
