// The 1-D mesh "x" over every rank that most DTensor tests place tensors on.
#pragma once

#include "hp/distributed/world.h"
#include "hp/mesh/device_mesh.h"

namespace hp::test {

inline DeviceMeshPtr world_mesh() {
  return init_device_mesh("cpu", {dist::get_world_size()}, {"x"});
}

}  // namespace hp::test
