// Which unit manages a parameter, looked up by the parameter itself.
//
// clip_grad_norm_ and the state-dict functions receive parameters or a
// model, not units; this maps a parameter's TensorImpl to its FSDPParam.
// Entries die with their unit.
#pragma once

#include <memory>
#include <optional>

#include <ATen/core/Tensor.h>

namespace hp::fsdp {

class Unit;
class FSDPParam;

struct ManagedParam {
  std::shared_ptr<Unit> unit;
  FSDPParam* param;
};

void register_param(const at::Tensor& param, const std::shared_ptr<Unit>& unit, FSDPParam* managed);
std::optional<ManagedParam> find_managed(const at::Tensor& param);
// Forgets `param` (a tensor replaced by another, materialize.h).
void unregister_param(const at::Tensor& param);

}  // namespace hp::fsdp
