// A program for the pipeline's failure test: under hprun on 2 ranks, rank 1
// hangs (sleeps instead of running its stage) while rank 0 runs a 1F1B
// step; rank 0's first receive of a gradient must time out within
// HP_TIMEOUT_S and end the job with a message naming the action, the peer
// and the transfer, never hang.
#include <torch/torch.h>

#include <chrono>
#include <iostream>
#include <thread>

#include "hp/distributed/world.h"
#include "hp/nn/gpt.h"
#include "hp/nn/loss.h"
#include "hp/pp/pipeline.h"
#include "hp/util/error.h"

int main() {
  hp::dist::init_process_group();
  const int rank = hp::dist::get_rank();
  if (rank == 1) std::this_thread::sleep_for(std::chrono::hours(1));
  hp::nn::GPTConfig config;  // 2 layers of width 64
  torch::manual_seed(1);
  hp::nn::GPT whole(config);
  const auto plan = hp::pp::plan_stages(hp::pp::gpt_layout(config), 2);
  hp::pp::Pipeline pipeline(
      {{hp::pp::ScheduleKind::k1F1B, 2, 1, 2}, config.n_embd}, {hp::pp::gpt_stage(*whole, plan, 0)},
      std::make_shared<hp::pp::GroupTransport>(hp::dist::world_group()),
      [](const at::Tensor& l, const at::Tensor& t) { return hp::nn::cross_entropy(l, t); });
  const at::Tensor ids = torch::randint(config.vocab_size, {4, 16}, torch::kLong);
  try {
    pipeline.step(ids, ids);
  } catch (const hp::CollectiveError& e) {
    std::cerr << "CollectiveError: " << e.what() << std::endl;
    return 1;
  }
  std::cerr << "the step returned although its peer never ran" << std::endl;
  return 2;
}
