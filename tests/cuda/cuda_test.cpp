// CUDA meshes (M3) and offload (F8). Every expected value is computed here:
// collectives move small integers (exact in fp32, whatever the order), and
// fully_shard's first step is compared with one process doing the same
// arithmetic on the same GPU.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdlib>
#include <string>
#include <vector>

#include "hp/dist/collectives.h"
#include "hp/dist/world.h"
#include "hp/fsdp/fully_shard.h"
#include "hp/mesh/device_mesh.h"
#include "hp/nn/gpt.h"
#include "hp/nn/loss.h"
#include "hp/util/error.h"
#include "hp/util/torch_compat.h"
#include "tests/support/rounding_bounds.h"

namespace hp {
namespace {

using ::testing::HasSubstr;
using ::testing::ThrowsMessage;

TEST(CudaMesh, ABuildWithoutCudaNamesWhatIsMissing) {
  if (compat::cuda_available()) GTEST_SKIP() << "this libtorch has CUDA and a device";
  const int64_t w = dist::get_world_size();
  EXPECT_THAT([&] { init_device_mesh("cuda", {w}); },
              ThrowsMessage<ArgumentError>(HasSubstr("device_type 'cuda' needs a")));
  if (!compat::has_nccl()) {
    dist::GroupOptions nccl;
    nccl.backend = dist::Backend::kNccl;
    EXPECT_THAT([&] { dist::new_group({0}, nccl); },
                ThrowsMessage<ArgumentError>(
                    HasSubstr("backend 'nccl' needs a libtorch built with NCCL")));
  }
}

class OnCuda : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!compat::cuda_available()) GTEST_SKIP() << "no CUDA in this libtorch or no device";
    mesh_ = init_device_mesh("cuda", {dist::get_world_size()});
    device_ = mesh_->device();
  }
  DeviceMeshPtr mesh_;
  at::Device device_{at::kCPU};
};

TEST_F(OnCuda, MeshUsesThisRanksGpuAndTheChosenBackend) {
  EXPECT_TRUE(device_.is_cuda());
  EXPECT_EQ(device_.index(), dist::launch_env().local_rank % compat::cuda_device_count());
  const char* env = std::getenv("HP_CUDA_BACKEND");
  const std::string expected = env && *env ? env : (compat::has_nccl() ? "nccl" : "gloo");
  EXPECT_EQ(dist::to_string(mesh_->backend()), expected);
  EXPECT_EQ(mesh_->group(0).backend_kind(), mesh_->backend());
}

TEST_F(OnCuda, CollectivesMatchTheCpuResult) {
  dist::Group& group = mesh_->group(0);
  const int64_t w = group.size(), r = group.rank();
  const auto f32 = at::TensorOptions().dtype(at::kFloat);
  // all_gather: rank q contributes [q + 1] * 3.
  at::Tensor out = at::empty({3 * w}, f32.device(device_));
  dist::all_gather_into(group, out, at::full({3}, double(r + 1), f32.device(device_))).wait();
  at::Tensor expected = at::arange(1, w + 1, f32).repeat_interleave(3);
  EXPECT_TRUE(at::equal(out.cpu(), expected)) << out.cpu();
  // reduce_scatter: rank q's input element j is 100 q + j; rank r receives
  // the sum over q of elements [2r, 2r + 2).
  at::Tensor in = at::arange(2 * w, f32) + 100.0 * double(r);
  at::Tensor part = at::empty({2}, f32.device(device_));
  dist::reduce_scatter(group, part, in.to(device_), dist::ReduceOp::kSum).wait();
  at::Tensor mine = at::arange(2 * r, 2 * r + 2, f32) * double(w) + 100.0 * double(w * (w - 1) / 2);
  EXPECT_TRUE(at::equal(part.cpu(), mine)) << part.cpu();
  // all_reduce: sum of q + 1 over the ranks.
  at::Tensor x = at::full({4}, double(r + 1), f32.device(device_));
  dist::all_reduce(group, x, dist::ReduceOp::kSum).wait();
  EXPECT_TRUE(at::equal(x.cpu(), at::full({4}, double(w * (w + 1) / 2), f32)));
  // all_gather_coalesced: two inputs, one collective (NCCL packs them).
  std::vector<at::Tensor> inputs{at::full({2}, double(r), f32.device(device_)),
                                 at::full({1}, double(10 * r), f32.device(device_))};
  std::vector<std::vector<at::Tensor>> outputs(w);
  for (int64_t q = 0; q < w; ++q) {
    outputs[q] = {at::empty({2}, f32.device(device_)), at::empty({1}, f32.device(device_))};
  }
  dist::all_gather_coalesced(group, outputs, inputs).wait();
  for (int64_t q = 0; q < w; ++q) {
    EXPECT_TRUE(at::equal(outputs[q][0].cpu(), at::full({2}, double(q), f32))) << "rank " << q;
    EXPECT_TRUE(at::equal(outputs[q][1].cpu(), at::full({1}, double(10 * q), f32)))
        << "rank " << q;
  }
}

// A GPT whose every dim 0 divides by 1, 2 and 4, so each rank's shard is
// exactly torch.chunk's piece.
nn::GPT make_gpt(at::Device device) {
  nn::GPTConfig config;
  config.vocab_size = 64;
  config.context = 16;
  config.n_layer = 2;
  config.n_head = 2;
  config.n_embd = 32;
  torch::manual_seed(7);
  nn::GPT model(config);
  model->to(device);
  return model;
}

at::Tensor loss_on_rows(nn::GPT& model, const at::Tensor& tokens, int64_t first, int64_t rows) {
  at::Tensor batch = tokens.narrow(0, first, rows);
  const int64_t t = tokens.size(1) - 1;
  return nn::cross_entropy(model(batch.narrow(1, 0, t)), batch.narrow(1, 1, t));
}

// One step of fully_shard against one process on the same GPU. Each rank's
// forward is the reference's forward of the same rows with the same
// parameters (gathered bit for bit), so its loss is the reference's part
// loss; the mean over ranks and the averaged gradients differ from the
// reference only in the order the parts are added: reordered_sum_bound of
// the parts. Then a second step checks that the next gather (from host
// memory when offloaded) and the optimizer's update work on where the
// shards live.
void expect_first_step_matches(const DeviceMeshPtr& mesh, bool offload, bool fused) {
  SCOPED_TRACE(std::string(offload ? "offload" : "on device") + (fused ? ", fused" : ""));
  const at::Device device = mesh->device();
  const int64_t w = dist::get_world_size(), r = dist::get_rank(), rows = 8 / w;
  at::Tensor tokens = at::randint(64, {8, 17}, at::detail::createCPUGenerator(11), at::kLong)
                          .to(device);

  nn::GPT reference = make_gpt(device);
  std::vector<std::pair<std::string, at::Tensor>> params;
  for (const auto& item : reference->named_parameters()) {
    params.emplace_back(item.key(), item.value());
  }
  std::vector<at::Tensor> grad_sum(params.size()), grad_abs(params.size());
  std::vector<double> part_losses;
  for (int64_t p = 0; p < w; ++p) {
    for (auto& [name, t] : params) t.mutable_grad() = at::Tensor();
    at::Tensor loss = loss_on_rows(reference, tokens, p * rows, rows);
    loss.backward();
    part_losses.push_back(loss.item<double>());
    for (size_t i = 0; i < params.size(); ++i) {
      at::Tensor g = params[i].second.grad().detach().to(at::kDouble) / double(w);
      grad_sum[i] = p == 0 ? g : grad_sum[i] + g;
      grad_abs[i] = p == 0 ? g.abs() : grad_abs[i] + g.abs();
    }
  }

  nn::GPT model = make_gpt(device);
  FullyShardOptions options;
  options.mesh = mesh;
  options.comm_fusion = fused;
  if (offload) options.offload_policy = OffloadPolicy::cpu(/*pin_memory=*/true);
  for (const nn::Block& block : model->blocks()) fully_shard(block.ptr(), options);
  FSDPModule root = fully_shard(model.ptr(), options);
  at::Tensor loss = loss_on_rows(model, tokens, r * rows, rows);
  EXPECT_EQ(loss.item<double>(), part_losses[r]) << "this rank's loss";
  loss.backward();

  size_t i = 0;
  for (const auto& item : model->named_parameters()) {
    SCOPED_TRACE(item.key());
    const at::Tensor& param = item.value();
    EXPECT_EQ(param.device().type(), offload && w > 1 ? at::kCPU : at::kCUDA);
    if (offload && w > 1) {
      EXPECT_TRUE(param.is_pinned());
    }
    ASSERT_TRUE(param.grad().defined());
    at::Tensor expected = grad_sum[i].chunk(w, 0)[w > 1 ? r : 0].cpu();
    at::Tensor bound = test::reordered_sum_bound(grad_abs[i].chunk(w, 0)[w > 1 ? r : 0].cpu(), w,
                                                 at::kFloat);
    EXPECT_TRUE(test::within_bound(param.grad().cpu(), expected, bound));
    ++i;
  }
  EXPECT_EQ(i, params.size());

  torch::optim::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(1e-3));
  optimizer.step();
  root.zero_grad();
  at::Tensor second = loss_on_rows(model, tokens, r * rows, rows);
  second.backward();
  EXPECT_TRUE(std::isfinite(second.item<double>()));
}

TEST_F(OnCuda, FullyShardFirstStepMatchesOneProcess) {
  for (bool fused : {false, true}) expect_first_step_matches(mesh_, /*offload=*/false, fused);
}

TEST_F(OnCuda, OffloadKeepsShardsInPinnedHostMemory) {
  for (bool fused : {false, true}) expect_first_step_matches(mesh_, /*offload=*/true, fused);
}

}  // namespace
}  // namespace hp
