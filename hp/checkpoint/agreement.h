// Errors agreed by every rank, so a failure on one rank (a file it cannot
// write, a piece that does not fit its layout) never leaves the others
// waiting in a collective: checkpoint steps run through run_agreed.
#pragma once

#include <functional>

namespace hp::checkpoint {

// Runs `fn` on this rank, then, in a distributed job, learns collectively
// (over the world) whether it raised on any rank: if so every rank raises
// the error of the lowest such rank, of the same kind (hp::ArgumentError,
// CheckpointError; anything else as CheckpointError), with its message.
// Every rank of the job must call it at the same point.
void run_agreed(const std::function<void()>& fn);

}  // namespace hp::checkpoint
