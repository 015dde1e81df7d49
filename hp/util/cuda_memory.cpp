#include "hp/util/cuda_memory.h"

#include "hp/util/error.h"
#include "hp/util/torch_compat.h"

// The device-generic allocator interface (at::getDeviceAllocator and its
// DeviceStats) is the one torch.accelerator.memory_stats reads; present in
// every 2.x this project is tested with (2.11, 2.15).
#if HP_TORCH_AT_LEAST(2, 11)
#include <ATen/DeviceAccelerator.h>
#define HP_HAS_DEVICE_ALLOCATOR_STATS 1
#endif

namespace hp {

namespace {

void check_device(int device_index) {
#ifndef HP_HAS_DEVICE_ALLOCATOR_STATS
  HP_CHECK_ARG(false, "CUDA memory statistics need libtorch 2.11 or later; this one is ",
               compat::torch_version());
#endif
  compat::require_cuda_device(device_index, "CUDA memory statistics");
}

}  // namespace

CudaMemoryStats cuda_memory_stats(int device_index) {
  check_device(device_index);
  CudaMemoryStats out;
#ifdef HP_HAS_DEVICE_ALLOCATOR_STATS
  // Index 0 of each StatArray is the aggregate over pool kinds (small and
  // large blocks).
  const auto stats = at::getDeviceAllocator(c10::DeviceType::CUDA)
                         ->getDeviceStats(static_cast<c10::DeviceIndex>(device_index));
  out.allocated_bytes = stats.allocated_bytes[0].current;
  out.peak_allocated_bytes = stats.allocated_bytes[0].peak;
  out.reserved_bytes = stats.reserved_bytes[0].current;
  out.peak_reserved_bytes = stats.reserved_bytes[0].peak;
#endif
  return out;
}

void reset_cuda_peak_memory(int device_index) {
  check_device(device_index);
#ifdef HP_HAS_DEVICE_ALLOCATOR_STATS
  at::getDeviceAllocator(c10::DeviceType::CUDA)
      ->resetPeakStats(static_cast<c10::DeviceIndex>(device_index));
#endif
}

}  // namespace hp
