// Helpers for fully_shard parity tests: the global batch, this rank's slice
// of it, and gathering a sharded model's parameters for comparison.
#pragma once

#include <torch/torch.h>

#include <map>
#include <string>

#include "hp/distributed/collectives.h"
#include "hp/distributed/comm_stats.h"
#include "hp/distributed/world.h"
#include "hp/fsdp/state_dict.h"
#include "hp/mesh/device_mesh.h"
#include "hp/nn/module.h"

namespace hp::test {

// A CPU data-parallel mesh: 1-D ("shard") for FSDP, 2-D ("replicate",
// "shard") for HSDP and DDP.
inline DeviceMeshPtr data_parallel_mesh(const std::vector<int64_t>& shape) {
  return init_device_mesh("cpu", shape,
                          shape.size() == 1 ? std::vector<std::string>{"shard"}
                                            : std::vector<std::string>{"replicate", "shard"});
}

// Step s's global batch: [batch, in] inputs and [batch, out] targets.
inline std::pair<at::Tensor, at::Tensor> global_batch(int step, int64_t batch = 12,
                                                      int64_t in = 6, int64_t out = 5) {
  at::Generator gen = at::detail::createCPUGenerator(500 + step);
  return {at::randn({batch, in}, gen), at::randn({batch, out}, gen)};
}

// Rows [r*B/D, (r+1)*B/D) of the batch for data-parallel rank r of D.
inline at::Tensor rows_for(const at::Tensor& t, int64_t dp_rank, int64_t dp_size) {
  const int64_t per = t.size(0) / dp_size;
  return t.narrow(0, dp_rank * per, per);
}

// Whole parameters of a (possibly sharded) model by name (collective).
inline std::map<std::string, at::Tensor> full_parameters(const nn::Module& model) {
  std::map<std::string, at::Tensor> out;
  for (auto& [name, value] : get_model_state_dict(model, {/*full_state_dict=*/true})) {
    out[name] = std::get<at::Tensor>(value);
  }
  return out;
}

// The mean of a per-rank scalar over the world (the global-batch loss).
inline double world_mean(double value) {
  if (!dist::is_initialized()) return value;
  at::Tensor t = at::full({1}, value, at::kDouble);
  dist::all_reduce(*dist::world_group(), t, dist::ReduceOp::kAvg).wait();
  return t.item<double>();
}

// All-gathers issued by `block`'s own pre-forward hook in its last forward
// (none when another unit prefetched it or it was already gathered),
// counted by hooks registered around fully_shard's.
template <typename Holder>
std::shared_ptr<int64_t> count_own_all_gathers(Holder& block) {
  auto before = std::make_shared<int64_t>(0);
  auto issued = std::make_shared<int64_t>(-1);
  block->register_forward_pre_hook(
      [before](nn::Module&, const nn::TensorList&) -> std::optional<nn::TensorList> {
        *before = dist::comm_stats()[dist::OpType::kAllGather];
        return std::nullopt;
      },
      /*prepend=*/true);
  block->register_forward_pre_hook(
      [before, issued](nn::Module&, const nn::TensorList&) -> std::optional<nn::TensorList> {
        *issued = dist::comm_stats()[dist::OpType::kAllGather] - *before;
        return std::nullopt;
      });
  return issued;
}

}  // namespace hp::test
