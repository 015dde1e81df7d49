// Keeps a fully_shard tree's parameters gathered for a run of forwards that
// need no gradients, such as sampling tokens one at a time.
//
// A sharded unit gathers its parameters in every forward and frees them
// after it (reshard_after_forward), so generating N tokens gathers the whole
// model N times. While this scope lives every unit keeps them after its
// first forward (set_reshard_after_forward(false): the next forward finds
// them unsharded and gathers nothing) and autograd is off; at its end every
// unit is resharded and gets back its reshard_after_forward. Collective
// like the forwards themselves: every rank opens and closes it together.
#pragma once

#include <c10/core/GradMode.h>

#include <cstdint>
#include <vector>

#include "hp/fsdp/fully_shard.h"

namespace hp::train {

class GatheredForInference {
 public:
  // `units`: every unit of the tree (the root and each inner unit; reshard()
  // acts on one unit only). `reshard_after_forward` is the setting to
  // restore, as hp-train's TrainOptions holds it: -1 true, 0 false, N > 0
  // groups of N ranks.
  GatheredForInference(std::vector<FSDPModule> units, int64_t reshard_after_forward);
  ~GatheredForInference();
  GatheredForInference(const GatheredForInference&) = delete;
  GatheredForInference& operator=(const GatheredForInference&) = delete;

 private:
  std::vector<FSDPModule> units_;
  int64_t reshard_after_forward_;
  c10::NoGradGuard no_grad_;
};

}  // namespace hp::train
