// The streams and the cross-unit stream state of one fully_shard tree
// (docs/streams.md): held by the tree's RootContext, created at the root's
// first forward, shared by every unit of the tree.
//
// It keeps what outlives one unit's call:
//   - the all-gather output of the unit whose forward is running, until the
//     next unit's unshard (at most two live at once, the kept one and the
//     one being gathered);
//   - the reduce-scatter inputs still being read on the reduce-scatter
//     stream, at most reduce_scatter_input_cap of them once the next one is
//     issued (compute waits the oldest one's event before dropping it).
// A buffer is released only on the stream it was allocated on, after that
// stream waited an event recorded after its last use elsewhere.
//
// With host-ordered ops (Gloo on the CPU) streams() is null and every call
// here is a no-op: the host's waits order everything.
//
// Threads: the tree's hooks, one at a time (unit.h).
#pragma once

#include <cstdint>
#include <deque>
#include <vector>

#include <ATen/core/Tensor.h>

#include "hp/distributed/stream_ops.h"

namespace hp::fsdp {

class CommContext {
 public:
  // The stream ops of `device` (dist::stream_ops_for).
  explicit CommContext(c10::Device device);
  ~CommContext();

  // Null when the host orders the work.
  dist::StreamOps* streams() const { return ops_; }

  // The root's pre-forward: the compute stream is the current one; the
  // copy-in and all-gather streams wait once for everything queued on it so
  // far (the optimizer step of the previous iteration), not at every gather.
  void begin_iteration();

  // A forward's all-gather output, allocated on the copy-in stream, read by
  // the copy-out on compute (event `copy_out`): kept until the next unit's
  // unshard, with `inputs` (allocated on the copy-in stream, read on the
  // all-gather stream). Replaces (and releases) the one kept before.
  void keep_all_gather_output(at::Tensor output, const dist::StreamEvent& copy_out,
                              std::vector<at::Tensor> inputs);
  // Releases a kept all-gather output: the copy-in and all-gather streams
  // wait its copy-out, then it is dropped on the copy-in stream.
  void release_all_gather_output();

  // A reduce-scatter input, allocated on compute, read on the
  // reduce-scatter stream until `read`. Beyond the cap, the oldest is
  // released after compute waited its event.
  void keep_reduce_scatter_input(at::Tensor input, const dist::StreamEvent& read);
  // The end of backward (and failure paths): compute waits every kept
  // input's event, then they are released.
  void release_reduce_scatter_inputs(const char* why);
  int64_t reduce_scatter_input_cap() const { return rs_input_cap_; }

  // Offload: a gradient's copy to the host was queued on compute
  // (FSDPParam::assign_grad). finish_offload_copies() blocks the host once
  // until every queued copy, and every copy of an offloaded shard to the
  // device read before it, completed: the optimizer may then step on the
  // host. Called where the reductions complete (the end of backward,
  // wait_for_gradients, the next iteration).
  void note_offload_copy() { offload_copies_ = true; }
  void finish_offload_copies();

 private:
  struct KeptBuffer {
    at::Tensor buffer;
    dist::StreamEvent last_use;
  };
  dist::StreamOps* ops_ = nullptr;
  KeptBuffer all_gather_output_;
  std::vector<at::Tensor> all_gather_inputs_;
  std::deque<KeptBuffer> rs_inputs_;
  int64_t rs_input_cap_ = 1;
  bool offload_copies_ = false;
};

}  // namespace hp::fsdp
