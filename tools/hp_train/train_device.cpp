#include "tools/hp_train/train_device.h"

#include "hp/distributed/launch_env.h"
#include "hp/util/error.h"
#include "hp/util/torch_compat.h"
#include "tools/hp_train/model_flops.h"

namespace hp::train {

TrainDevice select_device(const TrainOptions& options, const World& world) {
  TrainDevice chosen;
  chosen.type = resolve_device_type(options);
  if (chosen.type != "cuda") {
    HP_CHECK_ARG(options.peak_tflops == 0, "--peak-tflops ", options.peak_tflops,
                 " applies to --device cuda (the MFU of a GPU), but this run trains on the CPU");
    return chosen;
  }
  const int count = compat::cuda_device_count();
  const int index = world.launched ? dist::local_cuda_index(dist::read_launch_env(), count) : 0;
  chosen.device = compat::set_current_cuda_device(index);
  chosen.card = compat::cuda_device_name(index);
  chosen.peak_flops = options.peak_tflops > 0 ? std::optional<double>(options.peak_tflops * 1e12)
                                              : bf16_peak_flops(chosen.card);
  return chosen;
}

}  // namespace hp::train
