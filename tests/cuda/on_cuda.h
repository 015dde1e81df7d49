// The CUDA suite's fixture: a 1-D CUDA mesh over the world, or a skip where
// this libtorch has no CUDA or sees no device (so every file compiles on a
// CPU-only libtorch, 1.13 included, and runs only on a GPU machine).
#pragma once

#include <gtest/gtest.h>

#include <c10/core/Device.h>

#include "hp/distributed/world.h"
#include "hp/mesh/device_mesh.h"
#include "hp/util/torch_compat.h"

namespace hp::cuda_test {

class OnCuda : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!compat::cuda_available()) GTEST_SKIP() << "no CUDA in this libtorch or no device";
    mesh_ = init_device_mesh("cuda", {dist::get_world_size()});
    device_ = mesh_->device();
  }
  DeviceMeshPtr mesh_;
  c10::Device device_{c10::DeviceType::CPU};
};

}  // namespace hp::cuda_test
