// Pipeline checkpoints (hp/pp/pipeline_checkpoint.h) over real processes:
// a GPT trained as a pipeline over Gloo (pipeline rank = global rank), its
// checkpoint against the whole model trained in this process on the same
// micro-batches, bit for bit (the pipeline computes what one process does:
// tests/pp/pipeline_parity.h).
//
//   PipelineCheckpoint.*      on N ranks: save at pp = N, load into a whole
//                             model, resume at pp = N, refusals.
//   PipelineAcrossDegrees.*   Save on 2 ranks into HP_PIPELINE_CKPT_DIR, then
//                             Load on 4 ranks (pp = 4) and in one process
//                             (the whole model; plain load_into_shards).
//   PipelineState.*           one process: the holders' checks.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <torch/torch.h>

#include <cstdlib>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "hp/checkpoint/adamw_state.h"
#include "hp/checkpoint/checkpoint.h"
#include "hp/checkpoint/consolidated.h"
#include "hp/checkpoint/directory.h"
#include "hp/checkpoint/file_io.h"
#include "hp/checkpoint/load_into_shards.h"
#include "hp/checkpoint/metadata.h"
#include "hp/pp/pipeline_checkpoint.h"
#include "hp/checkpoint/training_state.h"
#include "hp/distributed/world.h"
#include "hp/nn/gpt.h"
#include "hp/nn/loss.h"
#include "hp/pp/pipeline.h"
#include "hp/util/error.h"
#include "tests/checkpoint/checkpoint_test_util.h"
#include "tests/support/model_configs.h"
#include "tests/support/random_tokens.h"
#include "tests/support/tensor_checks.h"

namespace hp::checkpoint {
namespace {

using pp::add_pipeline_adamw;
using pp::add_pipeline_model;
using pp::load_into_stages;
using pp::stage_holders;
using pp::StageHolders;

using testing::HasSubstr;

// Four blocks: one per stage at pp = 4. The same micro-batch count at every
// degree, so every degree computes the same values.
constexpr int64_t kLayers = 4;
constexpr int kMicrobatches = 4;
constexpr uint64_t kSeed = 21;

nn::GPTConfig config() { return hp::test::small_gpt_config(kLayers); }
std::vector<nn::ParameterShape> shapes() { return config().parameter_shapes(); }

at::Tensor batch(int step, uint64_t salt) {
  return hp::test::random_tokens({2 * kMicrobatches, 8}, config().vocab_size, 100 * step + salt);
}

torch::optim::AdamWOptions adamw() { return torch::optim::AdamWOptions(1e-2); }

// What a training step leaves: every parameter and its AdamW state, by name.
struct Trained {
  std::map<std::string, at::Tensor> tensors;  // "w", "w.exp_avg", "w.exp_avg_sq"
  std::map<std::string, int64_t> steps;       // "w" -> AdamW's step count
};

Trained trained(const std::vector<std::pair<std::string, at::Tensor>>& params,
                torch::optim::AdamW& optimizer) {
  Trained t;
  for (const auto& [name, p] : params) {
    auto& s = adamw_param_state(optimizer, p, false);
    t.tensors[name] = p.detach().clone();
    t.tensors[name + ".exp_avg"] = s.exp_avg().clone();
    t.tensors[name + ".exp_avg_sq"] = s.exp_avg_sq().clone();
    t.steps[name] = s.step();
  }
  return t;
}

// Every entry of `got` equals `want`'s of the same name, bit for bit.
void expect_same(const Trained& got, const Trained& want) {
  ASSERT_FALSE(got.tensors.empty());
  for (const auto& [name, t] : got.tensors) {
    ASSERT_TRUE(want.tensors.count(name)) << name;
    EXPECT_TRUE(hp::test::tensors_equal(t, want.tensors.at(name))) << name;
  }
  for (const auto& [name, step] : got.steps) EXPECT_EQ(step, want.steps.at(name)) << name;
}

// The whole model in this process, trained as the pipeline trains it.
struct Whole {
  nn::GPT model;
  std::unique_ptr<torch::optim::AdamW> optimizer;

  explicit Whole(uint64_t seed) : model(nullptr) {
    torch::manual_seed(seed);
    model = nn::GPT(config());
    optimizer = std::make_unique<torch::optim::AdamW>(model->parameters(), adamw());
  }
  void train(int from, int to) {
    for (int step = from; step < to; ++step) {
      optimizer->zero_grad();
      const auto ids = batch(step, 1).chunk(kMicrobatches);
      const auto targets = batch(step, 2).chunk(kMicrobatches);
      for (int k = 0; k < kMicrobatches; ++k) {
        (nn::cross_entropy(model->forward(ids[k]), targets[k]) / kMicrobatches).backward();
      }
      optimizer->step();
    }
  }
  std::vector<std::pair<std::string, at::Tensor>> params() const {
    std::vector<std::pair<std::string, at::Tensor>> out;
    for (const auto& item : model->named_parameters()) out.emplace_back(item.key(), item.value());
    return out;
  }
  Trained state() { return trained(params(), *optimizer); }
  // The training state as a pipeline checkpoint names it.
  void add_to(State& state) {
    add_model(state, *model);
    add_adamw(state, *optimizer, *model);
  }
};

Trained reference(int steps) {
  Whole whole(kSeed);
  whole.train(0, steps);
  return whole.state();
}

// This rank's stages of a pipeline of `world_size()` ranks (1F1B, one stage
// per rank) over the world group.
struct PipelineRank {
  pp::ScheduleSpec spec;
  std::shared_ptr<pp::GroupTransport> transport;
  std::vector<pp::StageModule> stages;
  StageHolders holders;
  std::unique_ptr<pp::Pipeline> pipeline;
  std::unique_ptr<torch::optim::AdamW> optimizer;

  // Weights from `seed` (drawn as the whole model draws them); on the meta
  // device, without a pipeline or an optimizer, when `meta`.
  explicit PipelineRank(uint64_t seed, bool meta = false)
      : spec{pp::ScheduleKind::k1F1B, hp::test::world_size(), 1, kMicrobatches},
        transport(std::make_shared<pp::GroupTransport>(dist::world_group())) {
    torch::manual_seed(seed);
    nn::GPT whole(config(), meta ? c10::Device(at::kMeta) : c10::Device(at::kCPU));
    const pp::StagePlan plan = pp::plan_stages(pp::gpt_layout(config()), pp::num_stages(spec));
    for (int s : pp::rank_stages(spec, hp::test::rank())) stages.push_back(pp::gpt_stage(*whole, plan, s));
    holders = stage_holders(plan, spec, *transport);
    if (meta) return;
    pipeline = std::make_unique<pp::Pipeline>(
        pp::PipelineOptions{spec, config().n_embd}, stages, transport,
        [](const at::Tensor& logits, const at::Tensor& targets) {
          return nn::cross_entropy(logits, targets);
        });
    optimizer = std::make_unique<torch::optim::AdamW>(pipeline->parameters(), adamw());
  }
  void train(int from, int to) {
    for (int step = from; step < to; ++step) {
      optimizer->zero_grad();
      pipeline->step(batch(step, 1), batch(step, 2));
      optimizer->step();
    }
  }
  std::vector<std::pair<std::string, at::Tensor>> params() const {
    std::vector<std::pair<std::string, at::Tensor>> out;
    for (const auto& s : stages)
      for (const auto& item : s->named_parameters()) out.emplace_back(item.key(), item.value());
    return out;
  }
  Trained state() { return trained(params(), *optimizer); }
  void add_to(State& state) {
    add_pipeline_model(state, stages, holders, shapes());
    add_pipeline_adamw(state, *optimizer, stages, holders, shapes());
  }
};

// What `want` holds of the names in `got`.
Trained only(const Trained& want, const Trained& got) {
  Trained out;
  for (const auto& [name, t] : got.tensors) out.tensors[name] = want.tensors.at(name);
  for (const auto& [name, s] : got.steps) out.steps[name] = want.steps.at(name);
  return out;
}

void require_ranks() {
  if (hp::test::world_size() < 2) GTEST_SKIP() << "a pipeline needs 2 or more ranks";
}

TEST(PipelineCheckpoint, SavesWhatTheWholeModelTrains) {
  require_ranks();
  if (IsSkipped()) return;
  hp::test::SharedTempDir dir("pipeline_save");
  PipelineRank rank(kSeed);
  rank.train(0, 2);
  State state;
  rank.add_to(state);
  const SaveResult saved = save(state, dir.path(), 2);

  // Each stage's rank wrote its stage's tensors, once: the metadata names
  // the holder's file for every chunk.
  const Metadata metadata =
      Metadata::parse(read_whole_file(saved.path + "/metadata.json"), "metadata.json");
  ASSERT_EQ(metadata.tensors.size(), state.entries().size());
  for (const auto& [key, record] : metadata.tensors) {
    const StateEntry& entry = *state.find(key);
    ASSERT_EQ(record.chunks.size(), 1u) << key;
    EXPECT_EQ(record.chunks[0].file, rank_file_name(entry.holders.at(0))) << key;
    EXPECT_EQ(entry.held_here, entry.holders.at(0) == hp::test::rank()) << key;
  }
  EXPECT_GT(saved.rank_bytes, 0u);

  // Into the whole model on every rank (a collective load of the same keys
  // everywhere), against the whole model trained here.
  Whole whole(/*seed=*/99);
  State whole_state;
  whole.add_to(whole_state);
  load(whole_state, saved.path);
  expect_same(whole.state(), reference(2));
}

TEST(PipelineCheckpoint, ResumesBitwise) {
  require_ranks();
  if (IsSkipped()) return;
  hp::test::SharedTempDir dir("pipeline_resume");
  PipelineRank first(kSeed);
  first.train(0, 1);
  {
    State state;
    first.add_to(state);
    save(state, dir.path(), 1);
  }
  first.train(1, 2);

  // Other weights and a fresh optimizer: all of step 1's state must come
  // from the checkpoint.
  PipelineRank resumed(/*seed=*/99);
  State state;
  resumed.add_to(state);
  load(state, dir.path());
  resumed.train(1, 2);
  expect_same(resumed.state(), first.state());
  expect_same(resumed.state(), only(reference(2), resumed.state()));
}

TEST(PipelineCheckpoint, LoadIntoStagesFromWholeModelCheckpoint) {
  require_ranks();
  if (IsSkipped()) return;
  hp::test::SharedTempDir dir("pipeline_from_whole");
  Whole whole(kSeed);
  whole.train(0, 2);
  State whole_state;
  whole.add_to(whole_state);
  save(whole_state, dir.path(), 2);
  export_consolidated(whole_state, dir / "whole.safetensors", "model.");
  const Trained want = reference(2);

  for (const std::string& path : {dir.path(), dir / "whole.safetensors"}) {
    SCOPED_TRACE(path);
    PipelineRank meta(kSeed, /*meta=*/true);
    load_into_stages(meta.stages, meta.holders, shapes(), path);
    for (const auto& [name, p] : meta.params()) {
      EXPECT_TRUE(hp::test::tensors_equal(p, want.tensors.at(name))) << name;
    }
  }
}

TEST(PipelineCheckpoint, MissingKeyIsNamed) {
  require_ranks();
  if (IsSkipped()) return;
  hp::test::SharedTempDir dir("pipeline_missing");
  // A checkpoint of the whole model without one block's weight.
  const std::string lacking = "h.1.mlp.c_fc.weight";
  Whole whole(kSeed);
  State state;
  for (const auto& [name, p] : whole.params()) {
    if (name != lacking) state.add("model." + name, p);
  }
  save(state, dir.path(), 0);
  PipelineRank meta(kSeed, /*meta=*/true);
  EXPECT_THAT([&] { load_into_stages(meta.stages, meta.holders, shapes(), dir.path()); },
              testing::ThrowsMessage<ArgumentError>(
                  HasSubstr("missing key(s) 'model." + lacking + "'")));
}

TEST(PipelineCheckpoint, RanksHoldingDifferentKeysAreRefused) {
  require_ranks();
  if (IsSkipped()) return;
  hp::test::SharedTempDir dir("pipeline_refused");
  PipelineRank rank(kSeed);
  // Each rank's own stage only, not the other stages' keys declared.
  State state;
  for (const auto& s : rank.stages) add_model(state, *s);
  EXPECT_THAT([&] { save(state, dir.path(), 1); },
              testing::ThrowsMessage<ArgumentError>(HasSubstr("the ranks' states differ")));
  // Two ranks that each claim to be a key's only holder.
  State misdeclared;
  add_pipeline_model(misdeclared, rank.stages, rank.holders, shapes());
  at::Tensor extra = at::zeros({2});
  if (hp::test::rank() <= 1) {
    misdeclared.add_held_by("extra", extra, {hp::test::rank()});
  } else {
    misdeclared.declare_held_by("extra", {2}, at::kFloat, {0});
  }
  EXPECT_THAT([&] { save(misdeclared, dir.path(), 1); },
              testing::ThrowsMessage<ArgumentError>(HasSubstr("the ranks' states differ")));
  EXPECT_FALSE(std::filesystem::exists(dir / checkpoint_dir_name(1)));
}

// Across pipeline degrees: a fixture saved on 2 ranks, read on 4 and in one
// process.
std::string fixture_dir() {
  const char* dir = std::getenv("HP_PIPELINE_CKPT_DIR");
  return dir ? dir : "";
}

TEST(PipelineAcrossDegrees, Save) {
  if (fixture_dir().empty()) GTEST_SKIP() << "HP_PIPELINE_CKPT_DIR is not set";
  require_ranks();
  if (IsSkipped()) return;
  const std::string root = fixture_dir();
  if (hp::test::rank() == 0) {
    std::filesystem::remove_all(root);
    std::filesystem::create_directories(root);
  }
  hp::test::SharedTempDir::sync();
  PipelineRank rank(kSeed);
  rank.train(0, 2);
  State state;
  rank.add_to(state);
  save(state, root + "/ckpt", 2);
  // And the whole model's weights as one file, read back from it.
  Whole whole(/*seed=*/99);
  State whole_state;
  whole.add_to(whole_state);
  load(whole_state, root + "/ckpt");
  export_consolidated(whole_state, root + "/whole.safetensors", "model.");
}

TEST(PipelineAcrossDegrees, Load) {
  if (fixture_dir().empty()) GTEST_SKIP() << "HP_PIPELINE_CKPT_DIR is not set";
  const std::string ckpt = fixture_dir() + "/ckpt";
  const std::string file = fixture_dir() + "/whole.safetensors";
  const Trained after2 = reference(2);
  const Trained after3 = reference(3);
  if (hp::test::world_size() == 1) {
    // The whole model in one process: load, train on, as if never split.
    Whole whole(/*seed=*/99);
    State state;
    whole.add_to(state);
    load(state, ckpt);
    expect_same(whole.state(), after2);
    whole.train(2, 3);
    expect_same(whole.state(), after3);
    // One stage of a pp = 2 plan through plain load_into_shards: a
    // checkpoint directory's other keys are ignored; a consolidated file's
    // other stages' tensors only with strict = false.
    nn::GPT meta_whole(config(), c10::Device(at::kMeta));
    const pp::StagePlan plan = pp::plan_stages(pp::gpt_layout(config()), 2);
    pp::StageModule stage = pp::gpt_stage(*meta_whole, plan, 1);
    load_into_shards(*stage, ckpt);
    for (const auto& item : stage->named_parameters()) {
      EXPECT_TRUE(hp::test::tensors_equal(item.value(), after2.tensors.at(item.key())))
          << item.key();
    }
    EXPECT_THAT([&] { load_into_shards(*stage, file); },
                testing::ThrowsMessage<ArgumentError>(HasSubstr("unexpected key(s) 'wte.weight'")));
    LoadIntoShardsOptions lenient;
    lenient.strict = false;
    load_into_shards(*stage, file, lenient);
    for (const auto& item : stage->named_parameters()) {
      EXPECT_TRUE(hp::test::tensors_equal(item.value(), after2.tensors.at(item.key())))
          << item.key();
    }
    return;
  }
  // pp = world size: the stages' weights alone (meta stages), from the
  // directory and from the file; then the whole training state, trained on.
  for (const std::string& path : {ckpt, file}) {
    SCOPED_TRACE(path);
    PipelineRank meta(kSeed, /*meta=*/true);
    load_into_stages(meta.stages, meta.holders, shapes(), path);
    for (const auto& [name, p] : meta.params()) {
      EXPECT_TRUE(hp::test::tensors_equal(p, after2.tensors.at(name))) << name;
    }
  }
  PipelineRank rank(/*seed=*/99);
  State state;
  rank.add_to(state);
  load(state, ckpt);
  expect_same(rank.state(), only(after2, rank.state()));
  rank.train(2, 3);
  expect_same(rank.state(), only(after3, rank.state()));
}

TEST(PipelineState, HoldersAreChecked) {
  if (hp::test::world_size() != 1) GTEST_SKIP() << "one process";
  State state;
  at::Tensor t = at::zeros({3});
  EXPECT_THAT([&] { state.add_held_by("a", t, {1}); },
              testing::ThrowsMessage<ArgumentError>(HasSubstr("not all ranks of this job of 1")));
  EXPECT_THAT([&] { state.declare_held_by("a", {3}, at::kFloat, {0}); },
              testing::ThrowsMessage<ArgumentError>(HasSubstr("adds its tensor (add_held_by)")));
  EXPECT_THAT([&] { state.add_held_by("a", t, {}); },
              testing::ThrowsMessage<ArgumentError>(HasSubstr("names no holder")));
  state.add_held_by("a", t, {0});
  EXPECT_TRUE(state.find("a")->held_here);
  // A pipeline key cannot be gathered by export_consolidated.
  EXPECT_THAT([&] { export_consolidated(state, "/nonexistent/x.safetensors"); },
              testing::ThrowsMessage<ArgumentError>(HasSubstr("is held by ranks [0] only")));
}

}  // namespace
}  // namespace hp::checkpoint
