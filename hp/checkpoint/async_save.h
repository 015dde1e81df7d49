// Asynchronous sharded checkpoints (C7 in docs/features.md): the same
// checkpoint as checkpoint.h's save(), written while training goes on.
//
//   hp::checkpoint::AsyncCheckpointer checkpointer;   // every rank, same point
//   for (step ...) {
//     train_step();
//     if (due) checkpointer.save(state_now(), "ckpt", step);  // returns after the snapshot
//   }
//   checkpointer.wait();                              // before exit or export
//
// Threads. save() runs on the caller's thread: it waits for the save in
// flight (at most one is), checks the state on every rank as save() does
// (agreed, collective), and copies every piece this rank writes (the pieces
// it owns, the int and generator entries) into host staging buffers, pinned
// when the piece is on a GPU; the copy is complete when save() returns, so
// the caller may change the parameters at once. A background thread then
// writes the rank's file, exchanges the ranks' reports, and rank 0 writes
// metadata.json and commits: the same code as a synchronous save
// (save_core.h), with checkpoint.h's crash safety (a kill during the write
// leaves every earlier checkpoint loadable).
//
// Staging in the background (Staging::kInBackground). The copy moves to the
// background thread too, so save() blocks only for the agreed checks. The
// state may be read meanwhile (a forward and backward read the parameters
// and write gradients only) but not changed: the caller calls
// wait_for_staging() before it changes a tensor of the state, e.g. before
// its optimizer step, which then blocks only if the copy is not done yet. A
// tensor changed in place before its copy ended is detected (its version
// counter moved between save() and the end of the copy) and fails the save
// on every rank, naming the tensor: a checkpoint never holds a mix of two
// steps.
//
// Communication. The background collectives run on a process group of their
// own over every rank (two threads issuing collectives on one Gloo group
// could pair them differently on different ranks), made collectively by the
// constructor: every rank constructs its checkpointers at the same point,
// in the same order (each gets its own group). The caller's thread agrees on
// save()'s checks over that group too, while no write is in flight.
//
// Memory. The staging buffers hold this rank's owned pieces (the size of its
// file) and are kept between saves: a save whose pieces have the shapes and
// dtypes of the previous one's allocates no staging memory. The snapshot is
// the checkpointer's; the State passed to save() may go away when it returns.
//
// Errors. Bad input raises hp::ArgumentError from save() on every rank, as
// save() does, before anything is copied. A failure of the background write
// is agreed across ranks (every rank gets the same CheckpointError) and is
// raised once, by the next save() or wait(); earlier checkpoints stay as
// they were. The destructor waits for the save in flight and never throws
// (a failure no call raised is written to stderr).
//
// One object is used from one thread (the training loop's).
#pragma once

#include <exception>
#include <future>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "hp/checkpoint/checkpoint.h"
#include "hp/checkpoint/state.h"

namespace hp::dist {
class Group;
}

namespace hp::checkpoint {

// When save() copies the state: before it returns, or on the background
// thread (see above).
enum class Staging { kBeforeReturn, kInBackground };

class AsyncCheckpointer {
 public:
  // Collective in a distributed job (makes the checkpointer's group).
  AsyncCheckpointer();
  ~AsyncCheckpointer();
  AsyncCheckpointer(const AsyncCheckpointer&) = delete;
  AsyncCheckpointer& operator=(const AsyncCheckpointer&) = delete;

  // Collectively starts saving `state` as ROOT/step-<step> (as
  // checkpoint.h's save()); returns once the snapshot is taken. Raises a
  // failure of the previous save (then starts nothing).
  void save(const State& state, const std::string& root, int64_t step,
            const SaveOptions& options = {}, Staging staging = Staging::kBeforeReturn);

  // Returns once the snapshot of the last save() is taken (at once when it
  // is, or when nothing is being saved). After it the state may change.
  // Never raises: a failure of the save is raised by save() or wait().
  void wait_for_staging();

  // Waits for the save in flight and returns the last save's result: its
  // stall_seconds is what its save() call blocked (the wait for the save
  // before it included), `seconds` the time from its checks (after that
  // wait) to its commit. Raises the failure of a save no call has
  // raised yet. An empty result (path "") before the first save.
  SaveResult wait();

  // Whether a save was started and wait() or save() has not yet joined it.
  bool in_flight() const { return writer_.joinable(); }

  // Bytes of host staging memory held (this rank's owned pieces).
  uint64_t staging_bytes() const;

 private:
  // Joins the writer, keeping its outcome in result_ / failure_.
  void join();

  std::shared_ptr<dist::Group> group_;  // null in one process
  std::vector<at::Tensor> staging_;
  std::thread writer_;
  std::shared_future<void> staged_;  // set by the writer once its copy is done
  SaveResult result_;
  std::exception_ptr failure_;
};

}  // namespace hp::checkpoint
