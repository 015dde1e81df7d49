// A fake GPU mark for trace tests (hp/util/gpu_trace.h): a point on a device
// clock given in milliseconds, always reached. Tests hand out marks at
// increasing times to stand for what CUDA events would measure.
#pragma once

#include "hp/util/gpu_trace.h"

namespace hp::test {

class ClockMark final : public trace::GpuMark {
 public:
  explicit ClockMark(double ms) : ms_(ms) {}
  bool reached() override { return true; }
  void synchronize() override {}
  double milliseconds_to(trace::GpuMark& later) override {
    return static_cast<ClockMark&>(later).ms_ - ms_;
  }

 private:
  double ms_;
};

}  // namespace hp::test
