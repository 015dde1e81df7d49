// One stage's backward of one micro-batch in two halves, for zero-bubble
// schedules (docs/pipeline.md): I computes the gradient of the stage's
// input, W later the gradients of its parameters.
//
// I walks the graph from the output: the nodes on a path from the output to
// the input form the input's part of the graph; where a path to a parameter
// leaves that part, a pre-hook on the last node inside it captures the
// gradients arriving there. I then runs autograd over the input's part only
// (the graph kept); mm, addmm and the norms compute only the input side
// there, since their backward formulas honour which outputs are needed. W
// runs the engine again from the captured gradients to the parameters'
// accumulators, accumulate_grad on, as backward(inputs=params) does: .grad
// accumulates and the accumulators' hooks run (fully_shard relies on them);
// the graph is freed then.
//
// Parameters inside an activation-checkpointed block are no edges of the
// outer graph (its function's own backward accumulates them), so their
// weight work stays in I.
//
// Not thread-safe; one object per (stage, micro-batch), used by one thread.
#pragma once

#include <ATen/core/Tensor.h>

#include <memory>
#include <vector>

namespace hp::pp {

class SplitBackward {
 public:
  // `output` was computed from `input` (a leaf requiring grad) and the
  // parameters `params` (leaves requiring grad).
  SplitBackward(at::Tensor output, at::Tensor input, std::vector<at::Tensor> params);
  ~SplitBackward();
  SplitBackward(const SplitBackward&) = delete;
  SplitBackward& operator=(const SplitBackward&) = delete;

  // I: returns d(output . grad_output)/d(input) (zeros where the input has
  // no path to the output), keeping the graph for W.
  at::Tensor backward_input(const at::Tensor& grad_output);
  // W: accumulates the parameters' gradients into .grad. After
  // backward_input, once.
  void backward_weight();

 private:
  struct Captures;
  at::Tensor output_;
  at::Tensor input_;
  at::Tensor grad_output_;  // kept for W when I had nothing to do
  std::vector<at::Tensor> params_;
  std::unique_ptr<Captures> captures_;
  bool input_done_ = false;
  bool weight_done_ = false;
};

}  // namespace hp::pp
