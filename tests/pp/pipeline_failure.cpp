// A program for the pipeline's failure test: under hprun on 2 ranks, rank 1
// hangs (starts its step, then sleeps in its first loss) while rank 0 runs a
// 1F1B step; rank 0's first receive of a gradient must time out within
// HP_TIMEOUT_S and end the job with a message naming the action, the peer
// and the transfer, never hang.
// With --fully-shard, on 4 ranks as (dp, pp) = (2, 2): the stages are
// fully_shard roots over dp and the ranks of pipeline rank 1 hang; the
// others' receive times out the same way, and afterwards their stage is
// resharded (the pipeline step cancelled) and the pipeline refuses a new
// step.
#include <torch/torch.h>

#include <chrono>
#include <iostream>
#include <string>
#include <thread>

#include "hp/distributed/world.h"
#include "hp/fsdp/fully_shard.h"
#include "hp/mesh/device_mesh.h"
#include "hp/nn/gpt.h"
#include "hp/nn/loss.h"
#include "hp/pp/pipeline.h"
#include "hp/util/error.h"

int main(int argc, char** argv) {
  const bool sharded = argc > 1 && std::string(argv[1]) == "--fully-shard";
  hp::dist::init_process_group();
  const int rank = hp::dist::get_rank();
  hp::DeviceMeshPtr mesh;
  if (sharded) mesh = hp::init_device_mesh("cpu", {2, 2}, {"dp", "pp"});
  const int pipeline_rank = sharded ? static_cast<int>(mesh->coordinate(1)) : rank;
  hp::nn::GPTConfig config;  // 2 layers of width 64
  torch::manual_seed(1);
  hp::nn::GPT whole(config);
  const auto plan = hp::pp::plan_stages(hp::pp::gpt_layout(config), 2);
  hp::pp::StageModule stage = hp::pp::gpt_stage(*whole, plan, pipeline_rank);
  std::vector<int64_t> shard_sizes;
  if (sharded) {
    hp::FullyShardOptions options;
    options.mesh = (*mesh)["dp"];
    for (const auto& block : stage->blocks()) hp::fully_shard(block, options);
    hp::fully_shard(stage.ptr(), options);
    for (const auto& p : stage->parameters()) shard_sizes.push_back(p.size(0));
  }
  hp::pp::Pipeline pipeline(
      {{hp::pp::ScheduleKind::k1F1B, 2, 1, 2}, config.n_embd}, {stage},
      std::make_shared<hp::pp::GroupTransport>(sharded ? mesh->group_ptr(1)
                                                       : hp::dist::world_group()),
      [pipeline_rank](const at::Tensor& l, const at::Tensor& t) {
        // Past the step's start (the neighbours agreed on their boundary):
        // pipeline rank 1 hangs in its first forward.
        if (pipeline_rank == 1) std::this_thread::sleep_for(std::chrono::hours(1));
        return hp::nn::cross_entropy(l, t);
      });
  const at::Tensor ids = torch::randint(config.vocab_size, {4, 16}, torch::kLong);
  try {
    pipeline.step(ids, ids);
  } catch (const hp::CollectiveError& e) {
    std::cerr << "CollectiveError: " << e.what() << std::endl;
    if (sharded) {
      std::vector<int64_t> sizes;
      for (const auto& p : stage->parameters()) sizes.push_back(p.size(0));
      if (sizes != shard_sizes) {
        std::cerr << "the stage was left gathered after the failed step" << std::endl;
        return 3;
      }
      try {
        pipeline.step(ids, ids);
        std::cerr << "a step after the failure ran" << std::endl;
        return 4;
      } catch (const hp::UnusableError&) {
        std::cerr << "stage resharded; the pipeline refuses a new step" << std::endl;
      }
    }
    return 1;
  }
  std::cerr << "the step returned although its peer never ran" << std::endl;
  return 2;
}
