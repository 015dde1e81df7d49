// Where hp-train computes: the device chosen from --device and the
// launcher's world, before any collective.
//
// cuda: local rank r takes GPU r (hp::dist::local_cuda_index: more local
// ranks than GPUs are refused unless HP_SHARE_GPUS=1), made the current
// device at once, so that every CUDA allocation of the run lands there.
// Errors are hp::ArgumentError naming the flag and what is missing.
#pragma once

#include <c10/core/Device.h>

#include <optional>
#include <string>

#include "tools/hp_train/train_options.h"

namespace hp::train {

struct TrainDevice {
  c10::Device device{c10::kCPU};
  std::string type = "cpu";          // "cuda" or "cpu", as init_device_mesh takes it
  std::string card;                  // CUDA's name for the GPU; empty on the CPU
  std::optional<double> peak_flops;  // dense bf16 FLOP/s (MFU); nullopt where unknown
  bool is_cuda() const { return device.is_cuda(); }
};

// Resolves --device (resolve_device_type), checks the GPU count against the
// local ranks, makes this rank's GPU current, and finds its bf16 peak
// (--peak-tflops, else the card's name). --peak-tflops on the CPU is refused.
TrainDevice select_device(const TrainOptions& options, const World& world);

}  // namespace hp::train
