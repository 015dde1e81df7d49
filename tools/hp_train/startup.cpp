#include "tools/hp_train/startup.h"

#include <torch/torch.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include <fmt/format.h>

#include "hp/checkpoint/checkpoint.h"
#include "hp/checkpoint/load_into_shards.h"
#include "hp/distributed/collectives.h"
#include "hp/fsdp/materialize.h"
#include "hp/util/cuda_memory.h"
#include "hp/util/error.h"
#include "hp/util/format.h"
#include "hp/util/memory_stats.h"
#include "tools/hp_train/init_weights.h"

namespace hp::train {
namespace {

// A "Vm...:" field of /proc/self/status in bytes (0 where there is none).
int64_t status_bytes(const std::string& field) {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind(field, 0) != 0) continue;
    std::istringstream fields(line.substr(field.size()));
    int64_t kib = 0;
    fields >> kib;
    return kib * 1024;
  }
  return 0;
}

int64_t resident_peak_bytes() { return status_bytes("VmHWM:"); }

std::string mib(int64_t bytes) { return fmt::format("{:.1f} MiB", bytes / 1048576.0); }

}  // namespace

int64_t resident_bytes() { return status_bytes("VmRSS:"); }

TrainModel build_model(const TrainOptions& options, int64_t vocab_size, bool meta) {
  const bool directory =
      !options.init_from.empty() && std::filesystem::is_directory(options.init_from);
  if (directory) {
    HP_CHECK_ARG(meta, "--init-from '", options.init_from,
                 "' is a directory: reading a checkpoint directory needs --init meta (each "
                 "rank reads its own shards); give a .safetensors file for --init eager");
    HP_CHECK_ARG(checkpoint::latest_checkpoint(options.init_from).has_value() ||
                     std::filesystem::exists(options.init_from + "/metadata.json"),
                 "--init-from '", options.init_from,
                 "' holds no complete checkpoint (a step-N directory with metadata.json)");
  }
  TrainModel model = TrainModel::build(options, vocab_size, meta ? at::kMeta : at::kCPU);
  if (!options.init_from.empty() && !directory) {
    if (meta) {
      check_initial_weights(model.module(), options.init_from);
    } else {
      load_initial_weights(model.module(), options.init_from);
    }
  }
  return model;
}

std::string materialize_model(const TrainModel& model, const TrainOptions& options, bool meta,
                              c10::Device device) {
  if (!meta) return "";
  if (options.init_from.empty()) {
    init_sharded(model.module(), model.init_plan(), device);
    return "init meta: each rank initialised only its shards (the eager model's values)";
  }
  checkpoint::LoadIntoShardsOptions load_options;
  load_options.device = device;
  const checkpoint::LoadResult loaded =
      checkpoint::load_into_shards(model.module(), options.init_from, load_options);
  return fmt::format("init meta: each rank read only its shards from {} ({} read by this rank)",
                     options.init_from, mib(static_cast<int64_t>(loaded.bytes_read)));
}

StartupMemory gather_startup_memory(dist::Group* group, int64_t before_model_bytes,
                                    std::optional<c10::Device> cuda_device) {
  const double cuda_peak =
      cuda_device ? static_cast<double>(cuda_memory_stats(cuda_device->index()).peak_allocated_bytes)
                  : 0.0;
  at::Tensor mine = torch::tensor({static_cast<double>(memory_stats().peak_bytes),
                                   static_cast<double>(resident_peak_bytes()), cuda_peak,
                                   static_cast<double>(before_model_bytes)},
                                  torch::kDouble);
  at::Tensor all = mine;
  if (group) {
    all = torch::empty({group->size() * 4}, torch::kDouble);
    dist::all_gather_into(*group, all, mine).wait();
  }
  all = all.view({-1, 4});
  StartupMemory memory;
  for (int64_t r = 0; r < all.size(0); ++r) {
    memory.peak_bytes.push_back(static_cast<int64_t>(all[r][0].item<double>()));
    memory.vmhwm_bytes.push_back(static_cast<int64_t>(all[r][1].item<double>()));
    if (cuda_device) memory.cuda_peak_bytes.push_back(static_cast<int64_t>(all[r][2].item<double>()));
    memory.before_model_bytes.push_back(static_cast<int64_t>(all[r][3].item<double>()));
  }
  return memory;
}

std::string startup_memory_table(const StartupMemory& memory, bool meta, int64_t parameter_count) {
  const auto ranks = static_cast<int64_t>(memory.peak_bytes.size());
  std::string text = fmt::format(
      "start-up peak per rank (--init {}; the fp32 model is {}, {} per rank of {}):",
      meta ? "meta" : "eager", mib(parameter_count * 4), mib(parameter_count * 4 / ranks), ranks);
  for (int64_t r = 0; r < ranks; ++r) {
    text += fmt::format("\n  rank {}: {} allocated by libtorch, VmHWM {}", r,
                        mib(memory.peak_bytes[r]), mib(memory.vmhwm_bytes[r]));
    if (r < static_cast<int64_t>(memory.before_model_bytes.size())) {
      text += fmt::format(" ({} of it before the model: the libraries, the corpus)",
                          mib(memory.before_model_bytes[r]));
    }
    if (!memory.cuda_peak_bytes.empty()) {
      text += fmt::format(", GPU {} allocated", mib(memory.cuda_peak_bytes[r]));
    }
  }
  return text;
}

}  // namespace hp::train
