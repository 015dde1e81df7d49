// CUDA meshes (M3) and offload (F8). Every expected value is computed here:
// collectives move small integers (exact in fp32, whatever the order), and
// fully_shard's first step is compared with one process doing the same
// arithmetic on the same GPU.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <string>
#include <vector>

#include "hp/checkpoint/checkpoint.h"
#include "hp/distributed/collectives.h"
#include "hp/distributed/world.h"
#include "hp/fsdp/clip_grad.h"
#include "hp/fsdp/fully_shard.h"
#include "hp/mesh/device_mesh.h"
#include "hp/nn/gpt.h"
#include "hp/nn/loss.h"
#include "hp/tensor/dtensor.h"
#include "hp/util/error.h"
#include "hp/util/torch_compat.h"
#include "tests/checkpoint/checkpoint_test_util.h"
#include "tests/cuda/on_cuda.h"
#include "tests/support/model_configs.h"
#include "tests/support/rounding_bounds.h"

namespace hp {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::ThrowsMessage;

TEST(CudaMesh, ABuildWithoutCudaNamesWhatIsMissing) {
  if (compat::cuda_available()) GTEST_SKIP() << "this libtorch has CUDA and a device";
  const int64_t w = dist::get_world_size();
  EXPECT_THAT([&] { init_device_mesh("cuda", {w}); },
              ThrowsMessage<ArgumentError>(HasSubstr("device_type 'cuda' needs a")));
  if (!compat::has_nccl()) {
    dist::GroupOptions nccl;
    nccl.backend = dist::BackendType::kNccl;
    EXPECT_THAT([&] { dist::new_group({0}, nccl); },
                ThrowsMessage<ArgumentError>(
                    HasSubstr("backend 'nccl' needs a libtorch built with NCCL")));
  }
}

using cuda_test::OnCuda;

TEST_F(OnCuda, MeshUsesThisRanksGpuAndTheChosenBackend) {
  EXPECT_TRUE(device_.is_cuda());
  EXPECT_EQ(device_.index(), dist::launch_env().local_rank % compat::cuda_device_count());
  const char* env = std::getenv("HP_CUDA_BACKEND");
  const std::string expected = env && *env ? env : (compat::has_nccl() ? "nccl" : "gloo");
  EXPECT_EQ(dist::to_string(mesh_->backend_type()), expected);
  EXPECT_EQ(mesh_->group(0).backend_type(), mesh_->backend_type());
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
  torch::manual_seed(7);
  nn::GPT model(test::gpt_config(
      {/*vocab=*/64, /*context=*/16, /*layers=*/2, /*heads=*/2, /*width=*/32}));
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

// The values the library exchanges for itself (a gradient norm, the index
// that load_state_dict's ranks agree on, from_local's local shapes) travel
// on the group's device: an NCCL group refuses CPU tensors, so each of
// these raised on its first call before.
// Every gradient element is 0.5, so the squared norm is numel / 4: sums of
// quarters, exact in double in any order, and the norm is sqrt's correctly
// rounded result on every rank.
TEST_F(OnCuda, ClipGradNormStaysOnTheGpuAndMatchesTheWholeNorm) {
  nn::GPT model = make_gpt(device_);
  int64_t numel = 0;
  for (const auto& p : model->parameters()) numel += p.numel();
  FullyShardOptions options;
  options.mesh = mesh_;
  for (const nn::Block& block : model->blocks()) fully_shard(block.ptr(), options);
  fully_shard(model.ptr(), options);
  for (auto& p : model->parameters()) p.mutable_grad() = at::full_like(p, 0.5);
  const double expected = std::sqrt(numel / 4.0);
  at::Tensor norm = clip_grad_norm_(model->parameters(), /*max_norm=*/1.0);
  EXPECT_TRUE(norm.is_cuda());
  EXPECT_EQ(norm.item<double>(), expected);
  // Scaled by 1 / (norm + 1e-6) in the gradients' dtype, as torch does.
  const float scaled = static_cast<float>(0.5f * static_cast<float>(1.0 / (expected + 1e-6)));
  for (const auto& p : model->parameters()) {
    EXPECT_EQ(p.grad().max().item<float>(), scaled);
  }
}

TEST_F(OnCuda, StateDictRoundTripAndCpuOffload) {
  nn::GPT model = make_gpt(device_);
  FullyShardOptions options;
  options.mesh = mesh_;
  for (const nn::Block& block : model->blocks()) fully_shard(block.ptr(), options);
  FSDPModule root = fully_shard(model.ptr(), options);
  StateDict sharded = root.state_dict();
  root.load_state_dict(sharded);  // agrees on the first rejected entry over NCCL
  StateDictOptions offload;
  offload.full_state_dict = true;
  offload.cpu_offload = true;
  nn::GPT reference = make_gpt(device_);
  auto expected = reference->named_parameters();
  for (const auto& [key, value] : get_model_state_dict(*model, offload)) {
    SCOPED_TRACE(key);
    const at::Tensor& whole = std::get<at::Tensor>(value);
    EXPECT_TRUE(whole.is_cpu());
    if (expected.contains(key)) {
      EXPECT_TRUE(at::equal(whole, expected[key].cpu()));
    }
  }
}

TEST_F(OnCuda, FromLocalRunCheckGathersShapesOnTheGroupsDevice) {
  const int64_t w = mesh_->size(), r = mesh_->coordinate(0);
  // Uneven rows, as torch.chunk splits 2w - 1 of them: two per rank, one on
  // the last (of two or more). run_check infers the total from the local
  // shapes and checks each against Shard(0)'s piece.
  const int64_t total = 2 * w - 1, chunk = (total + w - 1) / w;
  const int64_t rows = std::clamp<int64_t>(total - chunk * r, 0, chunk);
  at::Tensor local = at::full({rows, 3}, double(r), at::TensorOptions(at::kFloat).device(device_));
  FromLocalOptions check;
  check.run_check = true;
  DTensor d = from_local(local, Layout(mesh_, {Shard(0)}), check);
  EXPECT_EQ(d.sizes(), (std::vector<int64_t>{total, 3}));
}

TEST_F(OnCuda, CheckpointSavesAndLoadsGpuShards) {
  test::SharedTempDir dir("cuda");
  nn::GPT model = make_gpt(device_);
  FullyShardOptions options;
  options.mesh = mesh_;
  FSDPModule root = fully_shard(model.ptr(), options);
  checkpoint::State saved;
  for (const auto& [key, value] : root.state_dict()) saved.add(key, std::get<DTensor>(value));
  checkpoint::save(saved, dir.path(), /*step=*/1);
  std::vector<at::Tensor> before;
  for (auto& p : model->parameters()) {
    before.push_back(p.detach().clone());
    at::NoGradGuard no_grad;
    p.zero_();
  }
  checkpoint::load(saved, dir.path());
  size_t i = 0;
  for (auto& p : model->parameters()) {
    EXPECT_TRUE(p.is_cuda());
    EXPECT_TRUE(at::equal(p.detach(), before[i++]));
  }
}

// Where the parameters are decides the default mesh, and a misplaced module
// is named before any collective (every rank raises the same error).
TEST_F(OnCuda, DefaultMeshFollowsTheParametersAndMisplacedModulesAreNamed) {
  nn::GPT on_gpu = make_gpt(device_);
  FSDPModule root = fully_shard(on_gpu.ptr());
  for (const auto& p : on_gpu->parameters()) EXPECT_EQ(p.device(), device_);
  on_gpu->zero_grad();
  at::Tensor tokens = at::randint(64, {2, 17}, at::TensorOptions(at::kLong).device(device_));
  loss_on_rows(on_gpu, tokens, 0, 2).backward();

  // A CPU module under a 'cuda' mesh moves there, as FSDP2 moves it.
  nn::GPT on_cpu = make_gpt(at::kCPU);
  FullyShardOptions options;
  options.mesh = mesh_;
  fully_shard(on_cpu.ptr(), options);
  for (const auto& p : on_cpu->parameters()) EXPECT_TRUE(p.is_cuda());

  // A GPU module under a 'cpu' mesh is refused, naming a parameter.
  DeviceMeshPtr cpu_mesh = init_device_mesh("cpu", {dist::get_world_size()});
  nn::GPT misplaced = make_gpt(device_);
  options.mesh = cpu_mesh;
  EXPECT_THAT([&] { fully_shard(misplaced.ptr(), options); },
              ThrowsMessage<ArgumentError>(AllOf(HasSubstr("fully_shard: parameter '"),
                                                 HasSubstr("is on cuda"),
                                                 HasSubstr("pass a 'cuda' mesh"))));
}

}  // namespace
}  // namespace hp
