// When fully_shard gathers: a list of modules forms one unit, gathered
// by its first module's forward (and, once unit.cpp is fixed, only then:
// ModuleListUnit.GathersOncePerForward), and backward prefetch, implicit and
// explicit, issues the next unit's all-gather before that unit's backward
// starts.
// Each case also trains against the single-process model, with the
// derived bounds of parity_test.cpp: the reference runs the ranks' slices in
// turn (data_parallel_backward), so losses and gradients may differ only by
// the order their world-size terms are added in (reordered_sum_bound of the
// terms it recorded), and parameters after AdamW by what AdamWBound derives
// from those (tests/fsdp/data_parallel_reference.h).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "hp/distributed/comm_stats.h"
#include "hp/fsdp/fully_shard.h"
#include "hp/fsdp/storage.h"
#include "hp/tensor/shard_spec.h"
#include "tests/fsdp/data_parallel_reference.h"
#include "tests/fsdp/fsdp_test_util.h"
#include "tests/fsdp/gpt_fixture.h"
#include "tests/support/rounding_bounds.h"

namespace hp {
namespace {

// The toy model's residual block, with a probe inside: `probe` runs when
// the gradient of the block's residual branch arrives, i.e. during this
// block's backward, after fully_shard's pre-backward hook on the block's
// output and before the backward of any earlier block.
struct ProbeBlockImpl : nn::Module {
  ProbeBlockImpl(int64_t d, int64_t hidden) : nn::Module("ProbeBlock") {
    fc1 = register_module("fc1", torch::nn::Linear(d, hidden));
    fc2 = register_module("fc2", torch::nn::Linear(hidden, d));
  }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor branch = fc2(torch::gelu(fc1(x)));
    if (probe && branch.requires_grad()) {
      auto run = probe;
      branch.register_hook([run](const at::Tensor&) { run(); });
    }
    return x + branch;
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  std::function<void()> probe;
};
HP_MODULE(ProbeBlock);

struct ProbeModelImpl : nn::Module {
  ProbeModelImpl() : nn::Module("ProbeModel") {
    embed = register_module("embed", torch::nn::Linear(6, 10));
    blocks = register_module("blocks", torch::nn::ModuleList());
    for (int i = 0; i < 3; ++i) {
      ProbeBlock b(10, 14);
      blocks->push_back(b);
      block_list.push_back(b);
    }
    head = register_module("head", torch::nn::Linear(torch::nn::LinearOptions(10, 5).bias(false)));
  }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = embed(x);
    for (auto& b : block_list) h = b(h);
    if (head_probe && h.requires_grad()) {
      // A view of the last block's output: its hook runs once the head's
      // backward is done, after the root's pre-backward and before the last
      // block's (hooked on the block's output itself).
      h = h.view_as(h);
      auto run = head_probe;
      h.register_hook([run](const at::Tensor&) { run(); });
    }
    return head(h);
  }
  torch::nn::Linear embed{nullptr}, head{nullptr};
  torch::nn::ModuleList blocks{nullptr};
  std::vector<ProbeBlock> block_list;
  std::function<void()> head_probe;
};
HP_MODULE(ProbeModel);

ProbeModel make_probe_model() {
  torch::manual_seed(1234);
  return ProbeModel();
}

// expect_mse_step_matches on step `step`'s batch.
std::map<std::string, at::Tensor> expect_step_matches(
    ProbeModel& model, ProbeModel& reference, int step = 0,
    const std::function<void()>& before_backward = {}) {
  auto [x, y] = test::global_batch(step);
  return test::expect_mse_step_matches(model, reference, x, y, before_backward);
}

// Blocks 0 and 1 as one unit (block 2 and the root are units of their
// own), one step checked against the reference; returns the all-gathers
// each of the two blocks' own pre-forward issued.
struct PairCounts {
  int64_t own0 = -1, own1 = -1;
  bool b1_gathered_in_its_forward = false;
};

PairCounts run_pair_unit(bool fused) {
  auto reference = make_probe_model();
  auto model = make_probe_model();
  FullyShardOptions options;
  options.comm_fusion = fused;
  ProbeBlock b0 = model->block_list[0], b1 = model->block_list[1], b2 = model->block_list[2];
  FSDPModule pair =
      fully_shard(std::vector<std::shared_ptr<nn::Module>>{b0.ptr(), b1.ptr()}, options);
  fully_shard(b2.ptr(), options);
  FSDPModule root = fully_shard(model.ptr(), options);
  root.set_implicit_prefetch(false);
  EXPECT_TRUE(is_fully_sharded(*b1));
  EXPECT_EQ(&pair.module(), b0.ptr().get());
  const int64_t world = dist::get_world_size();
  // Both blocks' parameters are sharded by the one unit.
  EXPECT_EQ(b1->fc1->weight.size(0), chunk_span(14, world, dist::get_rank()).size);

  PairCounts counts;
  auto own0 = test::count_own_all_gathers(b0), own1 = test::count_own_all_gathers(b1);
  b1->register_forward_pre_hook(
      [&](nn::Module&, const nn::TensorList&) -> std::optional<nn::TensorList> {
        counts.b1_gathered_in_its_forward =
            b1->fc1->weight.size(0) == 14 && fsdp::storage_is_allocated(b1->fc1->weight);
        return std::nullopt;
      });
  expect_step_matches(model, reference);
  counts.own0 = *own0;
  counts.own1 = *own1;
  // Resharded after backward like any unit.
  EXPECT_EQ(b1->fc1->weight.size(0), chunk_span(14, world, dist::get_rank()).size);
  return counts;
}

TEST(ModuleListUnit, TwoBlocksAsOneUnitTrainLikeOneProcess) {
  for (bool fused : {false, true}) {
    SCOPED_TRACE(fused ? "fused" : "per parameter");
    const PairCounts counts = run_pair_unit(fused);
    if (dist::get_world_size() == 1) continue;  // nothing to gather
    // Block 0's forward gathers both blocks: the 8 parameters one all-gather
    // each, or one fused all-gather; block 1 runs on gathered parameters.
    EXPECT_EQ(counts.own0, fused ? 1 : 8);
    EXPECT_TRUE(counts.b1_gathered_in_its_forward);
  }
}

TEST(ModuleListUnit, GathersOncePerForward) {
  if (dist::get_world_size() < 2) GTEST_SKIP() << "one rank gathers nothing";
  for (bool fused : {false, true}) {
    SCOPED_TRACE(fused ? "fused" : "per parameter");
    // Block 1's forward finds the unit gathered by block 0's and issues none.
    EXPECT_EQ(run_pair_unit(fused).own1, 0);
  }
}

// All-gathers issued since `start` when each block's backward reached its
// probe, and whether the other blocks' parameters were gathered (or being
// gathered: their unsharded storage exists) at that point.
struct BackwardObservation {
  int64_t gathers = -1;
  std::vector<bool> gathered;
};

TEST(BackwardPrefetch, NextUnitIsGatheredBeforeItsBackwardStarts) {
  if (dist::get_world_size() < 2) GTEST_SKIP() << "one rank gathers nothing";
  enum class Mode { kNone, kImplicit, kExplicit };
  for (Mode mode : {Mode::kNone, Mode::kImplicit, Mode::kExplicit}) {
    const char* label = mode == Mode::kNone       ? "no prefetch"
                        : mode == Mode::kImplicit ? "implicit"
                                                  : "explicit: block 2 prefetches block 0";
    SCOPED_TRACE(label);
    auto reference = make_probe_model();
    auto model = make_probe_model();
    std::vector<FSDPModule> units;
    for (auto& block : model->block_list) units.push_back(fully_shard(block.ptr()));
    FSDPModule root = fully_shard(model.ptr());
    root.set_implicit_prefetch(mode == Mode::kImplicit);
    // Explicit: skip block 1, so the list (not the implicit order) decides.
    if (mode == Mode::kExplicit) units[2].set_modules_to_backward_prefetch({units[0]});

    // The first step records the execution order (implicit prefetch needs it).
    expect_step_matches(model, reference);
    root.zero_grad();
    reference->zero_grad();

    // All-gathers of the backward only: counted from the end of forward.
    int64_t start = 0;
    auto observe = [&](BackwardObservation& seen) {
      seen.gathers = dist::comm_stats()[dist::OpType::kAllGather] - start;
      for (auto& block : model->block_list) {
        seen.gathered.push_back(fsdp::storage_is_allocated(block->fc1->weight) &&
                                block->fc1->weight.size(0) == 14);
      }
    };
    std::vector<BackwardObservation> seen(3);
    BackwardObservation in_root;  // the root's backward, before block 2's
    for (size_t i = 0; i < 3; ++i) model->block_list[i]->probe = [&, i] { observe(seen[i]); };
    model->head_probe = [&] { observe(in_root); };
    // Prefetching changes when gathers happen, not the gradients.
    expect_step_matches(model, reference, /*step=*/1,
                        [&] { start = dist::comm_stats()[dist::OpType::kAllGather]; });
    for (auto& block : model->block_list) block->probe = nullptr;
    model->head_probe = nullptr;

    // A block unit has 4 parameters, gathered one all-gather each. Backward
    // runs the root's head, then block 2, 1, 0; the root kept its own
    // parameters from forward.
    const int64_t unit = 4;
    std::vector<int64_t> expected;
    std::vector<std::vector<bool>> gathered;
    int64_t expected_in_root = 0;
    std::vector<bool> gathered_in_root{false, false, false};
    switch (mode) {
      case Mode::kNone:  // each block gathers in its own pre-backward
        expected = {3 * unit, 2 * unit, unit};
        gathered = {{true, false, false}, {false, true, false}, {false, false, true}};
        break;
      case Mode::kImplicit:
        // The root's pre-backward starts block 2 (its forward ended last
        // before the root's), block k's starts block k-1.
        expected_in_root = unit;
        gathered_in_root = {false, false, true};
        expected = {3 * unit, 3 * unit, 2 * unit};
        gathered = {{true, false, false}, {true, true, false}, {false, true, true}};
        break;
      case Mode::kExplicit:  // block 2 starts block 0; block 1 gathers itself
        expected = {3 * unit, 3 * unit, 2 * unit};
        gathered = {{true, false, false}, {true, true, false}, {true, false, true}};
        break;
    }
    EXPECT_EQ(in_root.gathers, expected_in_root) << "all-gathers before the head's backward ends";
    EXPECT_EQ(in_root.gathered, gathered_in_root) << "blocks gathered during the root's backward";
    for (size_t i = 0; i < 3; ++i) {
      EXPECT_EQ(seen[i].gathers, expected[i]) << "all-gathers before block " << i << "'s backward";
      EXPECT_EQ(seen[i].gathered, gathered[i]) << "blocks gathered during block " << i
                                               << "'s backward";
    }
  }
}

// replicate_params on a mesh with replicas (HSDP, DDP) and on FSDP: the
// parameter stays whole and its gradient is averaged over every rank; with
// `fused` (comm_fusion), beside the fused shards of its unit.
void expect_replicated_params_train_like_one_process(bool fused) {
  for (const auto& mesh : test::mesh_configs()) {
    SCOPED_TRACE(mesh.name);
    auto reference = make_probe_model();
    auto model = make_probe_model();
    // One replicated parameter in a block unit, one in the root's.
    FullyShardOptions options;
    options.mesh = test::make_mesh(mesh);
    options.comm_fusion = fused;
    for (auto& block : model->block_list) {
      FullyShardOptions block_options = options;
      if (block.ptr() == model->block_list[1].ptr()) {
        block_options.replicate_params = {block->fc1->bias};
      }
      fully_shard(block.ptr(), block_options);
    }
    options.replicate_params = {model->head->weight};
    fully_shard(model.ptr(), options);
    EXPECT_EQ(model->head->weight.sizes().vec(), (std::vector<int64_t>{5, 10}));
    EXPECT_EQ(model->block_list[1]->fc1->bias.sizes().vec(), (std::vector<int64_t>{14}));
    auto ref_opt = test::make_adamw(*reference);
    auto opt = test::make_adamw(*model);
    test::AdamWBound adam(test::adamw_hyper());
    std::map<std::string, at::Tensor> param_bounds;
    // 3 AdamW steps, each from the reference's parameters (copy_parameters:
    // Adam's 1/sqrt(v) would carry one step's rounding into the next
    // step's gradients beyond any reordering bound). The replicated
    // parameters' gradients, whole on every rank, are checked like the
    // shards: averaged over every rank, within the reordering bound.
    for (int step = 0; step < 3; ++step) {
      SCOPED_TRACE("step " + std::to_string(step));
      test::copy_parameters(model, reference);
      auto grad_bounds = expect_step_matches(model, reference, step);
      param_bounds =
          test::step_and_expect_parameters_match(model, reference, opt, ref_opt, adam, grad_bounds);
    }
    // Whole on every rank, and gathered whole like every parameter: the
    // values step_and_expect_parameters_match checked shard by shard.
    EXPECT_EQ(model->head->weight.sizes().vec(), (std::vector<int64_t>{5, 10}));
    auto gathered = test::full_parameters(*model);
    for (auto& item : reference->named_parameters()) {
      EXPECT_TRUE(
          test::within_bound(gathered.at(item.key()), item.value(), param_bounds.at(item.key())))
          << item.key();
    }
  }
}

TEST(ReplicateParams, EveryMeshTrainsLikeOneProcess) {
  expect_replicated_params_train_like_one_process(/*fused=*/false);
}

// The toy model's sizes shard unevenly over 3 and 4 ranks; the replicated
// parameters' one all-reduce over the mesh adds the same terms as the
// per-parameter path in another order, so the same bounds hold.
TEST(ReplicateParams, FusedEveryMeshTrainsLikeOneProcess) {
  expect_replicated_params_train_like_one_process(/*fused=*/true);
}

}  // namespace
}  // namespace hp
