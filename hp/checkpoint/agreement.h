// Errors agreed by every rank, so a failure on one rank (a file it cannot
// write, a piece that does not fit its layout) never leaves the others
// waiting in a collective: checkpoint steps run through run_agreed.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

namespace hp::dist {
class Group;
}

namespace hp::checkpoint {

// Both take the group to agree over: nullptr is the world's; another must
// hold every rank of the world (AsyncCheckpointer's own group, so that its
// background thread never shares a group with training).

// Runs `fn` on this rank, then, in a distributed job, learns collectively
// (over `group`) whether it raised on any rank: if so every rank raises
// the error of the lowest such rank, of the same kind (hp::ArgumentError,
// CheckpointError; anything else as CheckpointError), with its message.
// Every rank of the job must call it at the same point.
void run_agreed(const std::function<void()>& fn, dist::Group* group = nullptr);

// Collective over `group`: whether every rank passed the same `value`
// (e.g. a checksum of the keys, shapes and dtypes of a state, which must
// agree before ranks plan collectives from them). One process: true.
bool same_on_every_rank(int64_t value, dist::Group* group = nullptr);

// Collective over `group`: raises CheckpointError on every rank when the
// ranks passed different `value`s (e.g. the step of the checkpoint each
// rank chose), naming `what`, the lowest and the highest value and a rank
// that passed each; `describe` turns a value into words for the message
// (e.g. -1 into "none"). One process: nothing.
void require_same_on_every_rank(int64_t value, const std::string& what,
                                const std::function<std::string(int64_t)>& describe,
                                dist::Group* group = nullptr);

}  // namespace hp::checkpoint
