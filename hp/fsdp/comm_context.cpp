#include "hp/fsdp/comm_context.h"

#include <ATen/ATen.h>

namespace hp::fsdp {

using dist::StreamRole;

CommContext::CommContext(c10::Device device) {
  dist::StreamOps& ops = dist::stream_ops_for(device);
  if (ops.orders_by_streams()) ops_ = &ops;
}

CommContext::~CommContext() {
  // Nothing may still read these: a tree is destroyed between steps.
  if (!ops_) return;
  try {
    release_all_gather_output();
    release_reduce_scatter_inputs("tree destroyed");
  } catch (...) {
  }
}

void CommContext::begin_iteration() {
  if (!ops_) return;
  ops_->begin_iteration();
  ops_->on_mark("iteration start");
  const dist::StreamEvent start = ops_->record(StreamRole::kCompute, "iteration start");
  ops_->wait(StreamRole::kCopyIn, start);
  ops_->wait(StreamRole::kAllGather, start);
}

void CommContext::keep_all_gather_output(at::Tensor output, const dist::StreamEvent& copy_out,
                                         std::vector<at::Tensor> inputs) {
  if (!ops_) return;
  release_all_gather_output();
  all_gather_output_ = {std::move(output), copy_out};
  all_gather_inputs_ = std::move(inputs);
}

void CommContext::release_all_gather_output() {
  if (!ops_ || !all_gather_output_.buffer.defined()) return;
  ops_->wait(StreamRole::kCopyIn, all_gather_output_.last_use);
  ops_->wait(StreamRole::kAllGather, all_gather_output_.last_use);
  ops_->on_release(all_gather_output_.buffer.data_ptr(), StreamRole::kCopyIn);
  {
    dist::StreamScope on(ops_, StreamRole::kCopyIn);
    all_gather_output_ = {};
    all_gather_inputs_.clear();
  }
}

void CommContext::finish_offload_copies() {
  if (!ops_ || !offload_copies_) return;
  offload_copies_ = false;
  ops_->host_wait(ops_->record(StreamRole::kCompute, "offload done"));
}

void CommContext::keep_reduce_scatter_input(at::Tensor input, const dist::StreamEvent& read) {
  if (!ops_) return;
  rs_inputs_.push_back({std::move(input), read});
  while (static_cast<int64_t>(rs_inputs_.size()) > rs_input_cap_) {
    KeptBuffer& oldest = rs_inputs_.front();
    ops_->on_mark("reduce-scatter input cap");
    ops_->wait(StreamRole::kCompute, oldest.last_use);
    ops_->on_release(oldest.buffer.data_ptr(), StreamRole::kCompute);
    rs_inputs_.pop_front();
  }
}

void CommContext::release_reduce_scatter_inputs(const char* why) {
  if (!ops_) return;
  if (!rs_inputs_.empty()) ops_->on_mark(why);
  for (KeptBuffer& kept : rs_inputs_) {
    ops_->wait(StreamRole::kCompute, kept.last_use);
    ops_->on_release(kept.buffer.data_ptr(), StreamRole::kCompute);
  }
  rs_inputs_.clear();
}

}  // namespace hp::fsdp
