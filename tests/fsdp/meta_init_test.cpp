// Deferred initialisation (F17, C6 in docs/features.md): a GPT (and a
// Llama) built on the meta device, sharded, then materialised and initialised in its shards,
// compared with the eager model sharded the same way. CTest runs it on 2, 3
// and 4 ranks (3 gives uneven, padded dim-0 shards).
//
// Every comparison is bit-exact: both sides draw the same numbers from the
// same generator state (init_plan.h) or read the same bytes, and then run
// the same sharded step on the same shards; no tolerance applies.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <map>
#include <string>

#include "hp/checkpoint/checkpoint.h"
#include "hp/checkpoint/load_into_shards.h"
#include "hp/checkpoint/safetensors.h"
#include "hp/checkpoint/training_state.h"
#include "hp/fsdp/materialize.h"
#include "hp/nn/llama.h"
#include "hp/nn/meta_device.h"
#include "hp/tensor/dtensor_tensor.h"
#include "hp/tp/gpt_plan.h"
#include "hp/tp/shard_module.h"
#include "hp/util/error.h"
#include "hp/util/memory_stats.h"
#include "tests/checkpoint/checkpoint_test_util.h"
#include "tests/fsdp/gpt_fixture.h"
#include "tests/support/model_configs.h"

namespace hp {
namespace {

using ::testing::HasSubstr;
using ::testing::ThrowsMessage;

constexpr uint64_t kSeed = 7;

// 4 blocks of d 64: one block (49k parameters) is far below the model
// (about 220k), so "the peak is one submodule" and "the peak is the model"
// are told apart.
nn::GPTConfig config() { return test::small_gpt_config(/*layers=*/4); }

nn::GPT eager_gpt() {
  torch::manual_seed(kSeed);
  return nn::GPT(config());
}

nn::GPT meta_gpt() {
  torch::manual_seed(kSeed);
  return nn::GPT(config(), at::kMeta);
}

FullyShardOptions fused(bool on) {
  FullyShardOptions options;
  options.comm_fusion = on;
  return options;
}

// Each parameter's local shard (a copy), by name.
std::map<std::string, at::Tensor> local_shards(const nn::Module& model) {
  std::map<std::string, at::Tensor> out;
  for (auto& [name, value] : get_model_state_dict(model)) {
    out[name] = std::holds_alternative<DTensor>(value) ? std::get<DTensor>(value).local().clone()
                                                       : std::get<at::Tensor>(value).clone();
  }
  return out;
}

void expect_same_shards(const nn::Module& actual, const nn::Module& expected) {
  auto a = local_shards(actual), e = local_shards(expected);
  ASSERT_EQ(a.size(), e.size());
  for (const auto& [name, shard] : e) {
    ASSERT_TRUE(a.count(name)) << name;
    EXPECT_FALSE(a[name].is_meta()) << name;
    EXPECT_TRUE(torch::equal(a[name], shard)) << name;
  }
}

int64_t bytes_of(const std::vector<at::Tensor>& tensors) {
  int64_t bytes = 0;
  for (const auto& t : tensors) bytes += t.numel() * t.element_size();
  return bytes;
}

int64_t largest_bytes(const std::vector<at::Tensor>& tensors) {
  int64_t bytes = 0;
  for (const auto& t : tensors) bytes = std::max<int64_t>(bytes, t.numel() * t.element_size());
  return bytes;
}

TEST(MetaInit, BuildingAndShardingOnMetaAllocatesNoFullParameter) {
  enable_memory_tracking();
  const int64_t world = dist::get_world_size();
  const std::vector<at::Tensor> whole = eager_gpt()->parameters();  // sizes only
  const int64_t model_bytes = bytes_of(whole);
  nn::GPT block_probe = eager_gpt();
  const int64_t block_bytes = bytes_of(block_probe->blocks()[0]->parameters());
  block_probe = nn::GPT(nullptr);

  reset_peak_memory();
  const int64_t before = memory_stats().current_bytes;
  nn::GPT model = meta_gpt();
  test::shard_gpt(model, {});
  // Built one submodule at a time (the largest is a block here), sharded
  // with nothing allocated: no parameter exists in memory yet.
  const int64_t build_peak = memory_stats().peak_bytes - before;
  EXPECT_LE(build_peak, block_bytes * 11 / 10) << "model " << model_bytes;
  EXPECT_LE(memory_stats().current_bytes - before, model_bytes / 100);
  for (const auto& p : model->parameters()) EXPECT_TRUE(p.is_meta());

  // Materialised: this rank's shards (dim 0 padded to ceil(rows / world))
  // and, while a step runs, one whole parameter on the CPU.
  reset_peak_memory();
  const int64_t materialised_before = memory_stats().current_bytes;
  init_sharded(*model, model->init_plan());
  int64_t padded_shards = 0;
  for (const auto& t : whole) {
    const int64_t rows = t.dim() == 0 ? 1 : t.size(0);
    padded_shards += (rows + world - 1) / world * (t.numel() / std::max<int64_t>(rows, 1)) * 4;
  }
  const int64_t held = memory_stats().current_bytes - materialised_before;
  const int64_t peak = memory_stats().peak_bytes - materialised_before;
  std::printf("[rank %lld] model %lld B, shards held %lld B (padded %lld), init peak %lld B\n",
              static_cast<long long>(dist::get_rank()), static_cast<long long>(model_bytes),
              static_cast<long long>(held), static_cast<long long>(padded_shards),
              static_cast<long long>(peak));
  EXPECT_EQ(held, padded_shards);
  // Beside the shards, only the scratch tensor of one step (its piece is a
  // view): at most the largest parameter.
  EXPECT_LE(peak, padded_shards + largest_bytes(whole));
}

TEST(MetaInit, ShardsEqualTheEagerModelsBitForBit) {
  for (bool fusion : {false, true}) {
    SCOPED_TRACE(fusion ? "comm_fusion" : "per parameter");
    nn::GPT eager = eager_gpt();
    test::shard_gpt(eager, fused(fusion));
    nn::GPT model = meta_gpt();
    test::shard_gpt(model, fused(fusion));
    init_sharded(*model, model->init_plan());
    expect_same_shards(*model, *eager);
  }
}

// The Llama (N5) through the same calls: its layers and the root as units.
TEST(MetaInit, LlamaShardsEqualTheEagerModelsBitForBit) {
  const nn::LlamaConfig llama = test::tiny_llama_config();
  auto build = [&](c10::Device device) {
    torch::manual_seed(kSeed);
    nn::Llama model(llama, device);
    for (const auto& layer : model->layers()) fully_shard(layer.ptr());
    fully_shard(model.ptr());
    return model;
  };
  nn::Llama eager = build(at::kCPU);
  nn::Llama model = build(at::kMeta);
  for (const auto& p : model->parameters()) EXPECT_TRUE(p.is_meta());
  init_sharded(*model, model->init_plan());
  expect_same_shards(*model, *eager);
}

TEST(MetaInit, TrainingAfterMetaInitEqualsTrainingAfterEagerInit) {
  nn::GPT eager = eager_gpt();
  test::shard_gpt(eager, {});
  nn::GPT model = meta_gpt();
  test::shard_gpt(model, {});
  init_sharded(*model, model->init_plan());
  auto eager_opt = test::make_adamw(*eager);
  auto meta_opt = test::make_adamw(*model);  // built after materialisation
  for (int s = 0; s < 2; ++s) {
    const at::Tensor tokens = test::token_batch(s);
    for (auto* pair : {&eager, &model}) {
      auto& opt = pair == &eager ? eager_opt : meta_opt;
      opt.zero_grad();
      test::gpt_loss(*pair, tokens, test::my_first_row(), test::my_rows()).backward();
      opt.step();
    }
  }
  expect_same_shards(*model, *eager);
}

// The eager model's whole tensors in one safetensors file, as PyTorch would
// write them (rank 0 writes; every rank reads).
std::string write_whole_model(const test::SharedTempDir& dir, nn::GPT& eager) {
  const std::string path = dir / "gpt.safetensors";
  if (dist::get_rank() == 0) {
    std::vector<std::pair<std::string, at::Tensor>> tensors;
    for (const auto& item : eager->named_parameters()) {
      tensors.emplace_back(item.key(), item.value());
    }
    checkpoint::write_safetensors(path, tensors);
  }
  test::SharedTempDir::sync();
  return path;
}

TEST(MetaInit, LoadsSafetensorsReadingOnlyItsOwnByteRanges) {
  test::SharedTempDir dir("meta_safetensors");
  nn::GPT whole = eager_gpt();
  const std::string path = write_whole_model(dir, whole);
  nn::GPT eager = eager_gpt();
  test::shard_gpt(eager, {});

  torch::manual_seed(99);  // other values: the file must be what counts
  nn::GPT model(config(), at::kMeta);
  test::shard_gpt(model, {});
  const checkpoint::LoadResult result = checkpoint::load_into_shards(*model, path);
  expect_same_shards(*model, *eager);
  // Exactly the bytes of this rank's (unpadded) dim-0 shards.
  int64_t own = 0;
  for (const auto& [name, shard] : local_shards(*model)) {
    own += shard.numel() * shard.element_size();
  }
  EXPECT_EQ(static_cast<int64_t>(result.bytes_read), own);
  EXPECT_LT(static_cast<int64_t>(result.bytes_read), bytes_of(whole->parameters()));
}

TEST(MetaInit, LoadsACheckpointSavedWithAnotherLayout) {
  // Saved from the whole model (every rank holds it whole, rank 0 writes:
  // a one-process job's layout), loaded into shards over this world.
  test::SharedTempDir dir("meta_checkpoint");
  nn::GPT whole = eager_gpt();
  checkpoint::State saved;
  checkpoint::add_model(saved, *whole);
  checkpoint::save(saved, dir.path(), 5);
  nn::GPT eager = eager_gpt();
  test::shard_gpt(eager, {});

  nn::GPT model(config(), at::kMeta);
  test::shard_gpt(model, {});
  const checkpoint::LoadResult result = checkpoint::load_into_shards(*model, dir.path());
  EXPECT_EQ(result.step, 5);
  expect_same_shards(*model, *eager);
}

TEST(MetaInit, TensorParallelWithFullyShardOnMeta) {
  // (dp, tp) = (1, world) when odd, else (2, world / 2).
  const int64_t world = dist::get_world_size();
  const int64_t dp = world % 2 == 0 && world > 2 ? 2 : 1;
  auto mesh = init_device_mesh("cpu", {dp, world / dp}, {"dp", "tp"});
  nn::GPTConfig c = config();
  c.n_embd = 48;  // 6 heads of 8: the heads split over 2 and 3 ranks
  c.n_head = 6;
  auto build = [&](c10::Device device) {
    torch::manual_seed(kSeed);
    nn::GPT model(c, device);
    shard_module(model, (*mesh)["tp"], gpt_tensor_parallel_plan(c, *(*mesh)["tp"]));
    FullyShardOptions options;
    options.mesh = (*mesh)["dp"];
    for (auto& block : model->blocks()) fully_shard(block.ptr(), options);
    fully_shard(model.ptr(), options);
    return model;
  };
  nn::GPT eager = build(at::kCPU);
  nn::GPT model = build(at::kMeta);
  for (const auto& p : model->parameters()) {
    EXPECT_TRUE((is_dtensor(p) ? local_of(p) : p).is_meta());
  }
  init_sharded(*model, model->init_plan());
  expect_same_shards(*model, *eager);
  // And it trains like the eager one.
  auto eager_opt = test::make_adamw(*eager);
  auto meta_opt = test::make_adamw(*model);
  const at::Tensor tokens = test::token_batch(0);
  const int64_t rows = test::kBatch / dp, first = (dist::get_rank() / (world / dp)) * rows;
  for (auto* m : {&eager, &model}) test::gpt_loss(*m, tokens, first, rows).backward();
  eager_opt.step();
  meta_opt.step();
  expect_same_shards(*model, *eager);
}

// A module with a buffer, for the errors.
struct WithBufferImpl : nn::Module {
  WithBufferImpl() : nn::Module("WithBuffer") {
    lin = register_module("lin", torch::nn::Linear(4, 4));
    scale = register_buffer("scale", torch::ones({4}));
  }
  at::Tensor forward(const at::Tensor& x) { return lin(x) * scale; }
  torch::nn::Linear lin{nullptr};
  at::Tensor scale;
};
HP_MODULE(WithBuffer);

TEST(MetaInit, UninitialisedTensorsAreNamedWithTheCallToMake) {
  WithBuffer model;
  nn::move_to_meta(*model);
  fully_shard(model.ptr());
  // A plan that forgets the buffer is refused before anything changes.
  nn::InitPlan partial{nn::normal_step("lin.weight", 0, 1), nn::fill_step("lin.bias", 0)};
  EXPECT_THAT([&] { init_sharded(*model, partial); },
              ThrowsMessage<ArgumentError>(HasSubstr("no step for ['scale']")));
  EXPECT_THAT([&] { model(torch::ones({2, 4})); },
              ThrowsMessage<ArgumentError>(AllOf(HasSubstr("'lin.weight'"),
                                                 HasSubstr("'scale (buffer)'"),
                                                 HasSubstr("hp::init_sharded(model, plan)"))));
  partial.push_back(nn::fill_step("scale", 2));
  init_sharded(*model, partial);
  EXPECT_EQ(model(torch::zeros({2, 4})).sizes(), (std::vector<int64_t>{2, 4}));
}

}  // namespace
}  // namespace hp
