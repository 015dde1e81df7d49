// CRC-32C (Castagnoli), the checksum of checkpoint files (C4 in
// docs/features.md): the polynomial iSCSI, ext4 and LevelDB use, which x86
// computes in hardware (SSE4.2), so checking a file costs less than reading it.
#pragma once

#include <cstddef>
#include <cstdint>

namespace hp::checkpoint {

// Extends `crc` (the value returned for the bytes before; 0 to start) with
// `size` bytes at `data`. crc32c(0, "123456789", 9) == 0xe3069283.
uint32_t crc32c(uint32_t crc, const void* data, size_t size);

}  // namespace hp::checkpoint
