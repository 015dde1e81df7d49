// A handle on an issued collective, in the spirit of c10d::Work.
//
// A collective runs on the backend's threads while the caller computes; the
// caller calls wait() before it touches the output. When the backend
// finishes, the local step that completes the collective on this rank (the
// sum of a reduce-scatter, the division of an average, the copy-back of a
// dtype the backend cannot move) and any continuations added with then() run
// on the backend's thread, so that they too overlap the caller's compute;
// the output is valid once wait() returns. A failure or timeout raises
// CollectiveError naming the op, the group's ranks, the tensor sizes and the
// group's sequence number. wait() is idempotent; the destructor does not
// block.
#pragma once

#include <functional>
#include <memory>

namespace hp::dist {

class Work {
 public:
  struct State;

  // A completed handle (what a world of one returns).
  Work() = default;
  explicit Work(std::shared_ptr<State> state) : state_(std::move(state)) {}

  // Blocks until the collective finished and its local completion ran.
  void wait();

  // Runs `fn` after the collective and its local step succeeded: on the
  // backend's thread, or right here if that already happened. For
  // bookkeeping that must follow completion (copying results out, releasing
  // buffers); an exception it throws is reported by wait().
  void then(std::function<void()> fn);

  // True once wait() has returned, or when the backend reports completion.
  bool is_completed() const;

 private:
  std::shared_ptr<State> state_;
};

}  // namespace hp::dist
