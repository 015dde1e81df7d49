#include "tools/hp_train/gathered_for_inference.h"

namespace hp::train {

GatheredForInference::GatheredForInference(std::vector<FSDPModule> units,
                                           int64_t reshard_after_forward)
    : units_(std::move(units)), reshard_after_forward_(reshard_after_forward) {
  for (FSDPModule& unit : units_) unit.set_reshard_after_forward(false, /*recurse=*/false);
}

GatheredForInference::~GatheredForInference() {
  for (FSDPModule& unit : units_) {
    unit.reshard();
    if (reshard_after_forward_ > 0) {
      unit.set_reshard_after_forward(reshard_after_forward_, /*recurse=*/false);
    } else {
      unit.set_reshard_after_forward(reshard_after_forward_ < 0, /*recurse=*/false);
    }
  }
}

}  // namespace hp::train
