// A handle on an issued collective, in the spirit of c10d::Work.
//
// How a collective completes depends on its backend (docs/streams.md):
//   NCCL     it is queued on the caller's current stream (c10d's
//            asyncOp=false: no c10d stream of its own, no c10d stash, no
//            future callback), its local step (an average's division, a
//            low-precision sum) queued right after it on the same stream,
//            and an event recorded there: event(). Nothing ever blocks the
//            host, except a barrier, which returns only once every rank
//            reached it.
//   Gloo and the shared-memory channel
//            the backend runs it on its own threads while the caller
//            computes; its local step runs there when it finishes. The
//            host is what waits.
// wait() and wait_on() are where a consumer meets the result: the
// consumer's stream waits the event (a CUDA stream, or a recorded one under
// the recording StreamOps); for a host-completed collective the calling
// thread first blocks until it finished. A failure or timeout of a
// host-completed collective raises CollectiveError naming the op, the
// group's ranks, the tensor sizes and the group's sequence number; an NCCL
// failure is reported by c10d's watchdog, which aborts the process
// (docs/streams.md). Waits are idempotent; the destructor does not block.
#pragma once

#include <memory>

#include "hp/distributed/stream_ops.h"

namespace hp::dist {

class Work {
 public:
  struct State;

  // A completed handle (what a world of one returns).
  Work() = default;
  explicit Work(std::shared_ptr<State> state) : state_(std::move(state)) {}

  // The calling thread's current stream waits for the collective (see the
  // file comment; on the host path the calling thread blocks).
  void wait();
  // `stream` (of the tensors' device's StreamOps) waits for it.
  void wait_on(StreamRole stream);
  // Recorded after the collective and its local step on the stream it was
  // issued on; undefined on the host path and for a trivial handle.
  StreamEvent event() const;

  // True once the collective and its local step finished: the backend
  // reported it (host path), or its event completed (stream path).
  bool is_completed() const;

 private:
  std::shared_ptr<State> state_;
};

}  // namespace hp::dist
