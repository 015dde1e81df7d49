// Keeps a fully_shard tree's parameters gathered for a run of forwards that
// need no gradients, such as sampling tokens one at a time.
//
// A sharded unit gathers its parameters in every forward and frees them
// after it (reshard_after_forward), so generating N tokens gathers the whole
// model N times. While this scope lives every unit keeps them after its
// first forward (set_reshard_after_forward(false): the next forward finds
// them unsharded and gathers nothing) and autograd is off; at its end every
// unit is resharded and gets back the reshard_after_forward it had.
// Collective like the forwards themselves: every rank opens and closes it
// together.
#pragma once

#include <c10/core/GradMode.h>

#include <cstdint>
#include <vector>

#include "hp/fsdp/fully_shard.h"

namespace hp::train {

class GatheredForInference {
 public:
  // `units`: every unit of the tree (the root and each inner unit; reshard()
  // acts on one unit only).
  explicit GatheredForInference(std::vector<FSDPModule> units);
  ~GatheredForInference();
  GatheredForInference(const GatheredForInference&) = delete;
  GatheredForInference& operator=(const GatheredForInference&) = delete;

 private:
  std::vector<FSDPModule> units_;
  std::vector<ReshardAfterForward> settings_;  // each unit's, to restore
  c10::NoGradGuard no_grad_;
};

}  // namespace hp::train
