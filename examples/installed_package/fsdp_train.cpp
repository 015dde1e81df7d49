// Trains a small GPT with fully_shard on every rank of the job and checks
// that it learns: the loss, averaged over the ranks, must fall over the
// steps, and every rank must report the same value. Exits non-zero if not.
//
//   hprun -n 2 fsdp_train          # CPU, Gloo
//   hprun -n 2 fsdp_train cuda     # CUDA tensors (NCCL, or Gloo with HP_CUDA_BACKEND=gloo)
#include <torch/torch.h>

#include <cstdio>
#include <string>

#include "hp/distributed/collectives.h"
#include "hp/distributed/world.h"
#include "hp/fsdp/fully_shard.h"
#include "hp/mesh/device_mesh.h"
#include "hp/nn/gpt.h"
#include "hp/nn/loss.h"

int main(int argc, char** argv) {
  const std::string device_type = argc > 1 ? argv[1] : "cpu";
  hp::dist::init_process_group();
  const int rank = hp::dist::get_rank(), world = hp::dist::get_world_size();
  at::set_num_threads(1);

  hp::FullyShardOptions options;
  options.mesh = hp::init_device_mesh(device_type, {world});
  options.comm_fusion = true;
  const at::Device device = options.mesh->device();  // cpu, or this rank's GPU

  hp::nn::GPTConfig config;
  config.vocab_size = 64;
  config.context = 32;
  config.n_layer = 2;
  config.n_head = 2;
  config.n_embd = 32;
  torch::manual_seed(0);  // the same initial weights on every rank
  hp::nn::GPT model(config);
  model->to(device);
  for (const hp::nn::Block& block : model->blocks()) hp::fully_shard(block.ptr(), options);
  hp::FSDPModule root = hp::fully_shard(model.ptr(), options);
  torch::optim::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(1e-2));

  // One fixed global batch of 8 sequences; this rank trains on its share.
  at::Generator generator = at::detail::createCPUGenerator(1234);
  at::Tensor batch = at::randint(config.vocab_size, {8, config.context + 1}, generator, at::kLong);
  const int64_t per_rank = 8 / world;
  batch = batch.narrow(0, rank * per_rank, per_rank).to(device);
  const at::Tensor inputs = batch.narrow(1, 0, config.context);
  const at::Tensor targets = batch.narrow(1, 1, config.context);

  hp::dist::Group& group = options.mesh->group(0);
  double first = 0, last = 0;
  for (int step = 0; step < 10; ++step) {
    at::Tensor loss = hp::nn::cross_entropy(model(inputs), targets);
    loss.backward();
    optimizer.step();
    root.zero_grad();
    at::Tensor mean = loss.detach().reshape({1});
    hp::dist::all_reduce(group, mean, hp::dist::ReduceOp::kAvg).wait();
    last = mean.item<double>();
    if (step == 0) first = last;
    if (rank == 0) std::printf("step %d loss %.4f\n", step, last);
  }
  // Every rank must hold the same mean: each compares its own with rank 0's.
  at::Tensor from_rank0 =
      at::full({1}, last, at::TensorOptions().dtype(at::kDouble).device(device));
  hp::dist::broadcast(group, from_rank0, 0).wait();
  const bool agree = from_rank0.item<double>() == last;
  const bool learned = last < first;
  if (rank == 0 || !agree) {
    std::printf("%s: %d ranks on %s, loss %.4f -> %.4f%s\n", learned && agree ? "ok" : "FAILED",
                world, device_type.c_str(), first, last,
                agree ? "" : " (differs from rank 0's)");
  }
  hp::dist::destroy_process_group();
  return learned && agree ? 0 : 1;
}
