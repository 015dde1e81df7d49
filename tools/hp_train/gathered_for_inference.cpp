#include "tools/hp_train/gathered_for_inference.h"

namespace hp::train {

GatheredForInference::GatheredForInference(std::vector<FSDPModule> units)
    : units_(std::move(units)) {
  for (FSDPModule& unit : units_) {
    settings_.push_back(unit.reshard_after_forward());
    unit.set_reshard_after_forward(false, /*recurse=*/false);
  }
}

GatheredForInference::~GatheredForInference() {
  for (size_t i = 0; i < units_.size(); ++i) {
    units_[i].reshard();
    units_[i].set_reshard_after_forward(settings_[i], /*recurse=*/false);
  }
}

}  // namespace hp::train
