// SHA-256 (FIPS 180-4) and HMAC-SHA256 (RFC 2104), for the agents'
// challenge-response (agent_protocol.h). hprun links no crypto library (it
// depends on nothing but libc and CLI11), and this is all it needs: a few
// MACs per connection, where speed does not matter. Tested against the
// published vectors (FIPS 180 examples, RFC 4231) in tests/launcher.
//
// Pure functions, thread-safe, no allocation beyond the returned values.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>

namespace hp::launcher {

using Digest = std::array<uint8_t, 32>;

Digest sha256(const std::string& data);
Digest hmac_sha256(const std::string& key, const std::string& message);

// Lowercase hex, 64 characters for a digest.
std::string to_hex(const uint8_t* data, std::size_t size);
std::string to_hex(const Digest& digest);

// Compares without an early exit, so the time taken does not tell an
// attacker how many leading bytes of a forged MAC were right.
bool constant_time_equal(const std::string& a, const std::string& b);

// `size` bytes from the kernel's CSPRNG (getrandom, blocking only until the
// pool is first initialised). Throws std::runtime_error if it fails.
std::string random_bytes(std::size_t size);

}  // namespace hp::launcher
