// Helpers the tensor-parallel tests share.
#pragma once

#include <ATen/ATen.h>

#include "hp/dist/world.h"
#include "hp/mesh/device_mesh.h"
#include "hp/tensor/dtensor_tensor.h"

namespace hp::test {

// A 1-D mesh "tp" over every rank.
inline DeviceMeshPtr tp_mesh() {
  return init_device_mesh("cpu", {dist::get_world_size()}, {"tp"});
}

// The whole value of a parameter, gradient or output (gathered if a DTensor).
inline at::Tensor whole(const at::Tensor& t) {
  at::NoGradGuard no_grad;
  return is_dtensor(t) ? full_tensor(t) : t.detach();
}

}  // namespace hp::test
