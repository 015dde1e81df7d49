// Errors of sharded checkpoints.
#pragma once

#include <stdexcept>
#include <string>

namespace hp::checkpoint {

// A checkpoint that cannot be read or written: a missing, truncated or
// corrupt file (a checksum that does not match), an I/O failure. The message
// names the file. Bad arguments (a key the checkpoint lacks, another shape
// or dtype) raise hp::ArgumentError instead.
class CheckpointError : public std::runtime_error {
 public:
  explicit CheckpointError(const std::string& what) : std::runtime_error(what) {}
};

}  // namespace hp::checkpoint
