// hp-train's start-up (F17 in docs/features.md): the model built eagerly (the
// whole model on every rank) or on the meta device (each rank materialises
// only its shards after parallelize), and the start-up memory every rank
// reports.
#pragma once

#include <c10/core/Device.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "hp/distributed/group.h"
#include "tools/hp_train/model.h"
#include "tools/hp_train/train_options.h"

namespace hp::train {

// The model --model names (vocabulary `vocab_size`), drawn from the
// generator state torch::manual_seed already set: whole under eager (with
// --init-from loaded into it), on meta otherwise (--init-from checked from
// its header, or as a checkpoint directory). Raises ArgumentError for a
// file or directory that does not fit; communicates nothing.
TrainModel build_model(const TrainOptions& options, int64_t vocab_size, bool meta);

// Under meta, after parallelize: this rank's shards materialised and filled
// from the model's init steps (the eager model's values) or read from
// --init-from (its own byte ranges only). Returns a line for the log, empty
// under eager. Collective when reading --init-from.
// Tensors outside fully_shard units and tensor-parallel meshes (--mode none
// with --init meta) are materialised on `device`; the others where their
// unit or mesh lives.
std::string materialize_model(const TrainModel& model, const TrainOptions& options, bool meta,
                              c10::Device device);

// The process's resident size now (VmRSS of /proc/self/status; 0 where
// there is none).
int64_t resident_bytes();

struct StartupMemory {
  std::vector<int64_t> peak_bytes;   // per rank: libtorch's CPU peak so far (memory_stats)
  std::vector<int64_t> vmhwm_bytes;  // per rank: the process's resident peak (VmHWM)
  // per rank: the resident size before the model was built (the libraries'
  // pages, the corpus): the VmHWM beyond it is the model's start-up
  std::vector<int64_t> before_model_bytes;
  // per rank: the CUDA caching allocator's peak of allocated bytes so far;
  // empty on the CPU
  std::vector<int64_t> cuda_peak_bytes;
};

// Every rank's figures, gathered over `group` (null: this process alone);
// `before_model_bytes`: this rank's resident_bytes() before the model was
// built; `cuda_device`: this rank's GPU, whose allocator peak is gathered too.
StartupMemory gather_startup_memory(dist::Group* group, int64_t before_model_bytes,
                                    std::optional<c10::Device> cuda_device = std::nullopt);

// One line per rank, next to the model's fp32 bytes divided by the ranks.
std::string startup_memory_table(const StartupMemory& memory, bool meta, int64_t parameter_count);

}  // namespace hp::train
