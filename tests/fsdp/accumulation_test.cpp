// Gradient accumulation and resharding as FSDP2 defines them: the
// collectives of an accumulation window for each pattern (no-sync on the
// whole tree, on the root only, on some blocks; HSDP's reduce-scatter-only
// micro-batches; reshard_after_forward's four settings; reshard_after_backward
// off), with the counts FSDP2's own tests state, and gradient and parameter
// parity with one process after each window. Then the case FSDP2 leaves
// open: a copy kept by reshard_after_backward(false) across an optimizer
// step is stale, and the next forward gathers again.
//
// The model: the toy model's three blocks are units, the root holds the
// embedding and the head. The reference processes each micro-batch's global
// batch as the ranks' slices (data_parallel_backward) and accumulates; the
// bounds are those of tests/fsdp/data_parallel_reference.h: gradients within
// the reordering bound of the terms the reference recorded over the window,
// parameters after AdamW within AdamWBound of those.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <optional>

#include "hp/distributed/comm_stats.h"
#include "hp/distributed/world.h"
#include "hp/fsdp/fully_shard.h"
#include "hp/fsdp/storage.h"
#include "hp/tensor/shard_spec.h"
#include "hp/util/trace.h"
#include "tests/fsdp/data_parallel_reference.h"
#include "tests/fsdp/fsdp_test_util.h"
#include "tests/fsdp/toy_model.h"

namespace hp {
namespace {

constexpr int64_t kBlocks = 3;       // the toy model's blocks: one unit each
constexpr int64_t kMicroBatches = 3;
constexpr int64_t kWindows = 2;

test::AdamWHyper adamw_hyper() { return {1e-2, 0.9, 0.95, 1e-8, 0.1}; }

torch::optim::AdamW make_optimizer(nn::Module& model) {
  const test::AdamWHyper h = adamw_hyper();
  return torch::optim::AdamW(model.parameters(), torch::optim::AdamWOptions(h.lr)
                                                     .betas({h.beta1, h.beta2})
                                                     .eps(h.eps)
                                                     .weight_decay(h.weight_decay));
}

// Which units skip gradient synchronisation on the window's first
// micro-batches (FSDP2's test modes).
enum class Mode { kAll, kRootOnly, kSomeBlocks };
constexpr int64_t kBlocksWithoutSync = 2;  // kSomeBlocks: the first two

struct Pattern {
  Mode mode;
  ReshardAfterForward reshard_after_forward;
  bool reshard_after_backward;  // false: off on the window's first micro-batches
  bool hsdp;                    // a (2, world / 2) mesh
  bool reduce_scatter_only;     // HSDP: set_requires_all_reduce instead of no-sync
  bool fused;

  std::string name() const {
    std::string s = mode == Mode::kAll ? "all" : mode == Mode::kRootOnly ? "root only" : "some";
    s += " raf=";
    if (!reshard_after_forward) {
      s += "default";
    } else if (const bool* b = std::get_if<bool>(&*reshard_after_forward)) {
      s += *b ? "true" : "false";
    } else {
      s += std::to_string(std::get<int64_t>(*reshard_after_forward));
    }
    s += reshard_after_backward ? "" : " rab=false";
    s += hsdp ? (reduce_scatter_only ? " hsdp rs-only" : " hsdp") : " fsdp";
    s += fused ? " fused" : "";
    return s;
  }
  bool keeps_after_forward() const {
    const bool* b = reshard_after_forward ? std::get_if<bool>(&*reshard_after_forward) : nullptr;
    return b && !*b;
  }
};

// The collectives of one window, counted per unit collective: each unit
// issues one per gather or reduction when fused, one per sharded parameter
// otherwise.
struct Counts {
  int64_t all_gather = 0, reduce_scatter = 0, all_reduce = 0;
};

// FSDP2's expected counts for a window (its test_gradient_accumulation),
// in unit collectives: `blocks` for the three blocks together, `root` for
// the root; the root resharding after forward only when asked explicitly.
struct Expected {
  Counts blocks, root;
};

Expected expected_counts(const Pattern& p) {
  const int64_t m = kMicroBatches;
  Expected e;
  // Reduce-scatters: every unit on the last micro-batch, and on the others
  // each unit that still synchronises.
  e.blocks.reduce_scatter = kBlocks;
  e.root.reduce_scatter = 1;
  if (p.mode == Mode::kSomeBlocks) {
    e.blocks.reduce_scatter += (kBlocks - kBlocksWithoutSync) * (m - 1);
    e.root.reduce_scatter += m - 1;
  } else if (p.mode == Mode::kRootOnly) {
    e.blocks.reduce_scatter += kBlocks * (m - 1);
  }
  // HSDP all-reduces follow the reduce-scatters that synchronise fully.
  if (p.hsdp) {
    e.blocks.all_reduce = e.blocks.reduce_scatter;
    e.root.all_reduce = e.root.reduce_scatter;
  }
  if (p.reduce_scatter_only) {
    // Reduce-scatter on every micro-batch, all-reduce on the last only.
    e.blocks.reduce_scatter = kBlocks * m;
    e.root.reduce_scatter = m;
  }
  // All-gathers: every unit in the first micro-batch's forward.
  e.blocks.all_gather = kBlocks;
  e.root.all_gather = 1;
  if (!p.keeps_after_forward()) {
    // Backward gathers again, every micro-batch: each block, and the root
    // when its setting is explicit (the default keeps the root's).
    e.blocks.all_gather = 2 * kBlocks * m;
    e.root.all_gather = (p.reshard_after_forward ? 2 : 1) * m;
  } else if (p.reshard_after_backward) {
    e.blocks.all_gather *= m;
    e.root.all_gather *= m;
  } else if (p.mode == Mode::kRootOnly) {
    // Only the root keeps its copy across micro-batches.
    e.blocks.all_gather += kBlocks * (m - 1);
  }
  // (kAll with both off: kept from the first forward to the last backward.)
  return e;
}

// The sharded parameters of a block and of the root (toy_model.h: a block's
// fc1, fc2 weights and biases; the root's embed weight and bias and head).
constexpr int64_t kBlockParams = 4;
constexpr int64_t kRootParams = 3;

Counts total(const Expected& e, bool fused) {
  const int64_t block = fused ? 1 : kBlockParams, root = fused ? 1 : kRootParams;
  Counts c;
  c.all_gather = e.blocks.all_gather * block + e.root.all_gather * root;
  c.reduce_scatter = e.blocks.reduce_scatter * block + e.root.reduce_scatter * root;
  c.all_reduce = e.blocks.all_reduce * block + e.root.all_reduce * root;
  return c;
}

std::vector<Pattern> patterns() {
  const int64_t w = dist::get_world_size();
  std::vector<ReshardAfterForward> rafs = {std::nullopt, true, false};
  // An int that is not the shard size itself: groups of 2 of 4 ranks.
  if (w == 4) rafs.emplace_back(int64_t{2});
  std::vector<Pattern> out;
  for (bool fused : {false, true}) {
    for (Mode mode : {Mode::kAll, Mode::kRootOnly, Mode::kSomeBlocks}) {
      for (const auto& raf : rafs) {
        for (bool rab : {true, false}) {
          Pattern p{mode, raf, rab, false, false, fused};
          // As in FSDP2's test: keeping copies after backward goes with
          // keeping them after forward, on the whole tree or the root.
          if (!rab && (!p.keeps_after_forward() || mode == Mode::kSomeBlocks)) continue;
          out.push_back(p);
          if (w == 4) {
            p.hsdp = true;
            out.push_back(p);
            p.reduce_scatter_only = true;
            // Only the whole tree's all-reduce is deferred in FSDP2's test.
            if (mode == Mode::kAll) out.push_back(p);
          }
        }
      }
    }
  }
  return out;
}

struct ShardedBlocks {
  test::ToyModel model;
  FSDPModule root;
  std::vector<FSDPModule> blocks;
};

ShardedBlocks shard(const Pattern& p) {
  auto model = test::make_toy_model(kBlocks);
  FullyShardOptions options;
  const int64_t w = dist::get_world_size();
  options.mesh = test::data_parallel_mesh(p.hsdp ? std::vector<int64_t>{2, w / 2}
                                                 : std::vector<int64_t>{w});
  options.reshard_after_forward = p.reshard_after_forward;
  options.comm_fusion = p.fused;
  std::vector<FSDPModule> blocks;
  for (auto& block : model->block_list) blocks.push_back(fully_shard(block.ptr(), options));
  FSDPModule root = fully_shard(model.ptr(), options);
  return {model, root, blocks};
}

void set_sync(FSDPModule& unit, const Pattern& p, bool on, bool recurse) {
  if (p.reduce_scatter_only) {
    unit.set_requires_all_reduce(on, recurse);
  } else {
    unit.set_requires_gradient_sync(on, recurse);
  }
}

// FSDP2's set_backward_flags: sync (and, when the pattern turns it off,
// reshard_after_backward) only on the last micro-batch, for the units the
// mode names.
void set_backward_flags(ShardedBlocks& s, const Pattern& p, bool last) {
  switch (p.mode) {
    case Mode::kAll:
      set_sync(s.root, p, last, /*recurse=*/true);
      if (!p.reshard_after_backward) s.root.set_reshard_after_backward(last);
      break;
    case Mode::kRootOnly:
      set_sync(s.root, p, last, /*recurse=*/false);
      if (!p.reshard_after_backward) s.root.set_reshard_after_backward(last, false);
      break;
    case Mode::kSomeBlocks:
      for (int64_t b = 0; b < kBlocksWithoutSync; ++b) {
        set_sync(s.blocks[b], p, last, /*recurse=*/false);
        if (!p.reshard_after_backward) s.blocks[b].set_reshard_after_backward(last, false);
      }
      break;
  }
}

Counts counts_of(const dist::CommStats& s) {
  return {s[dist::OpType::kAllGather], s[dist::OpType::kReduceScatter],
          s[dist::OpType::kAllReduce]};
}

void operator+=(Counts& a, const Counts& b) {
  a.all_gather += b.all_gather;
  a.reduce_scatter += b.reduce_scatter;
  a.all_reduce += b.all_reduce;
}

// Drops (set to none) or zeroes in place every gradient of `model`.
void clear_grads(nn::Module& model, bool drop) {
  for (auto& p : model.parameters()) {
    if (!p.grad().defined()) continue;
    if (drop) {
      p.mutable_grad() = at::Tensor();
    } else {
      p.grad().zero_();
    }
  }
}

TEST(GradientAccumulation, CollectivesAndParityPerPattern) {
  if (dist::get_world_size() < 2) GTEST_SKIP() << "one rank communicates nothing";
  const int64_t world = dist::get_world_size();
  for (const Pattern& p : patterns()) {
    SCOPED_TRACE(p.name());
    const int64_t dp_rank = dist::get_rank();  // every rank is data-parallel
    auto reference = test::make_toy_model(kBlocks);
    auto ref_opt = make_optimizer(*reference);
    ShardedBlocks s = shard(p);
    auto opt = make_optimizer(*s.model);
    test::AdamWBound adam(adamw_hyper());
    test::reference_gradient_terms().clear();
    for (int64_t window = 0; window < kWindows; ++window) {
      SCOPED_TRACE("window " + std::to_string(window));
      Counts counted;
      for (int64_t micro = 0; micro < kMicroBatches; ++micro) {
        const bool last = micro == kMicroBatches - 1;
        set_backward_flags(s, p, last);
        auto [x, y] = test::global_batch(static_cast<int>(window * kMicroBatches + micro));
        at::Tensor ref_loss = test::data_parallel_backward(
            reference->parameters(), reference->parameters(), world, [&](int64_t part) {
              return torch::mse_loss(reference(test::rows_for(x, part, world)),
                                     test::rows_for(y, part, world));
            });
        const dist::CommStats before = dist::comm_stats();
        at::Tensor loss = torch::mse_loss(s.model(test::rows_for(x, dp_rank, world)),
                                          test::rows_for(y, dp_rank, world));
        loss.backward();
        counted += counts_of(dist::comm_stats() - before);
        EXPECT_TRUE(test::within_bound(test::world_mean(loss.item<double>()), ref_loss.item<double>(),
                                 test::loss_bound(ref_loss, world)))
            << "loss of micro-batch " << micro;
      }
      const Counts expected = total(expected_counts(p), p.fused);
      EXPECT_EQ(counted.all_gather, expected.all_gather);
      EXPECT_EQ(counted.reduce_scatter, expected.reduce_scatter);
      EXPECT_EQ(counted.all_reduce, expected.all_reduce);

      // The window's gradients: the sum of its micro-batches' means.
      const auto grad_bounds = test::expect_gradients_match(s.model, reference);
      std::map<std::string, at::Tensor> param_bounds;
      for (auto& item : reference->named_parameters()) {
        param_bounds[item.key()] = adam.step(item.key(), item.value().detach(),
                                             item.value().grad(), grad_bounds.at(item.key()));
      }
      ref_opt.step();
      opt.step();
      auto ref = reference->named_parameters();
      auto mine = s.model->named_parameters();
      for (auto& [name, value] : s.root.state_dict()) {
        const Layout& layout = std::get<DTensor>(value).layout();
        EXPECT_TRUE(test::within_bound(mine[name], distribute_tensor(ref[name].detach(), layout).local(),
                                 distribute_tensor(param_bounds.at(name), layout).local()))
            << name << " after the optimizer step";
      }
      // Alternate FSDP2's zero_grad(set_to_none) settings: in place, dropped.
      const bool drop = window % 2 == 1;
      clear_grads(*reference, drop);
      clear_grads(*s.model, drop);
    }
  }
}

// Keeps the gathered copies after every backward, with gradient sync on:
// the optimizer's step changes the shards, so each copy is stale by the
// next forward. Gathers on every forward anyway, trains like one process,
// and the trace says so once per unit.
TEST(GradientAccumulation, KeptCopyAfterAnOptimizerStepIsGatheredAgain) {
  if (dist::get_world_size() < 2) GTEST_SKIP() << "one rank gathers nothing";
  const int64_t world = dist::get_world_size(), rank = dist::get_rank();
  for (bool fused : {false, true}) {
    SCOPED_TRACE(fused ? "fused" : "per parameter");
    Pattern p{Mode::kAll, false, false, false, false, fused};
    auto reference = test::make_toy_model(kBlocks);
    auto ref_opt = make_optimizer(*reference);
    ShardedBlocks s = shard(p);
    s.root.set_reshard_after_backward(false);
    auto opt = make_optimizer(*s.model);
    test::AdamWBound adam(adamw_hyper());
    test::reference_gradient_terms().clear();
    trace::enable(static_cast<int>(rank), "test");
    const int64_t per_unit = fused ? 1 : kBlockParams;
    for (int step = 0; step < 3; ++step) {
      SCOPED_TRACE("step " + std::to_string(step));
      auto [x, y] = test::global_batch(step);
      at::Tensor ref_loss = test::data_parallel_backward(
          reference->parameters(), reference->parameters(), world, [&](int64_t part) {
            return torch::mse_loss(reference(test::rows_for(x, part, world)),
                                   test::rows_for(y, part, world));
          });
      const dist::CommStats before = dist::comm_stats();
      at::Tensor out = s.model(test::rows_for(x, rank, world));
      const Counts forward = counts_of(dist::comm_stats() - before);
      // Every unit gathers in forward: at step 0 nothing was kept, after
      // that every kept copy predates the optimizer's step.
      EXPECT_EQ(forward.all_gather, kBlocks * per_unit + (fused ? 1 : kRootParams));
      // The loss is computed on the stepped parameters, as the reference's.
      at::Tensor loss = torch::mse_loss(out, test::rows_for(y, rank, world));
      loss.backward();
      EXPECT_TRUE(test::within_bound(test::world_mean(loss.item<double>()), ref_loss.item<double>(),
                               test::loss_bound(ref_loss, world)))
          << "loss";
      // Between steps the parameters hold their shards (the optimizer steps
      // them) while the copies are kept.
      EXPECT_EQ(s.model->head->weight.size(0), chunk_span(5, world, rank).size);
      const auto grad_bounds = test::expect_gradients_match(s.model, reference);
      for (auto& item : reference->named_parameters()) {
        adam.step(item.key(), item.value().detach(), item.value().grad(),
                  grad_bounds.at(item.key()));
      }
      ref_opt.step();
      opt.step();
      clear_grads(*reference, true);
      clear_grads(*s.model, true);
    }
    int64_t said = 0;
    for (const auto& e : trace::events()) {
      if (e.name.rfind("stale kept copy of ", 0) == 0) ++said;
    }
    trace::disable();
    // Steps 1 and 2 found every unit's copy stale; each unit said so once.
    EXPECT_EQ(said, kBlocks + 1);
  }
}

// Without a step in between, a kept copy is current: a second forward and
// backward (accumulating, gradients synchronised) gathers nothing in its
// forward, and the gradients are the two backwards' sum.
TEST(GradientAccumulation, KeptCopyWithoutAStepIsUsedAsItIs) {
  if (dist::get_world_size() < 2) GTEST_SKIP() << "one rank gathers nothing";
  const int64_t world = dist::get_world_size(), rank = dist::get_rank();
  for (bool fused : {false, true}) {
    SCOPED_TRACE(fused ? "fused" : "per parameter");
    auto reference = test::make_toy_model(kBlocks);
    ShardedBlocks s = shard(Pattern{Mode::kAll, false, false, false, false, fused});
    s.root.set_reshard_after_backward(false);
    test::reference_gradient_terms().clear();
    for (int micro = 0; micro < 2; ++micro) {
      auto [x, y] = test::global_batch(micro);
      test::data_parallel_backward(reference->parameters(), reference->parameters(), world,
                                   [&](int64_t part) {
                                     return torch::mse_loss(
                                         reference(test::rows_for(x, part, world)),
                                         test::rows_for(y, part, world));
                                   });
      const dist::CommStats before = dist::comm_stats();
      at::Tensor out = s.model(test::rows_for(x, rank, world));
      const Counts forward = counts_of(dist::comm_stats() - before);
      if (micro == 1) {
        EXPECT_EQ(forward.all_gather, 0);
      }
      torch::mse_loss(out, test::rows_for(y, rank, world)).backward();
    }
    test::expect_gradients_match(s.model, reference);
    // reshard() releases the copies: the next forward gathers.
    for (auto& block : s.blocks) block.reshard();
    s.root.reshard();
    const dist::CommStats before = dist::comm_stats();
    {
      at::NoGradGuard no_grad;
      s.model(test::rows_for(test::global_batch(0).first, rank, world));
    }
    EXPECT_GT((dist::comm_stats() - before)[dist::OpType::kAllGather], 0);
  }
}

// reshard_after_forward's default: every unit but the root frees after
// forward; an explicit true frees the root's too (gathered again in its
// pre-backward); the getter says what was set.
TEST(ReshardAfterForwardDefault, RootKeepsUnlessAskedExplicitly) {
  if (dist::get_world_size() < 2) GTEST_SKIP() << "one rank gathers nothing";
  const int64_t world = dist::get_world_size(), rank = dist::get_rank();
  for (const ReshardAfterForward& raf : {ReshardAfterForward(), ReshardAfterForward(true)}) {
    SCOPED_TRACE(raf ? "true" : "default");
    ShardedBlocks s = shard(Pattern{Mode::kAll, raf, true, false, false, false});
    EXPECT_EQ(s.root.reshard_after_forward().has_value(), raf.has_value());
    auto [x, y] = test::global_batch(0);
    at::Tensor loss = torch::mse_loss(s.model(test::rows_for(x, rank, world)),
                                      test::rows_for(y, rank, world));
    // Between forward and backward: the blocks hold no gathered memory; the
    // root holds its head gathered only by default.
    const bool root_gathered = s.model->head->weight.size(0) == 5 &&
                               fsdp::storage_is_allocated(s.model->head->weight);
    EXPECT_EQ(root_gathered, !raf.has_value());
    EXPECT_FALSE(fsdp::storage_is_allocated(s.model->block_list[0]->fc1->weight));
    const dist::CommStats before = dist::comm_stats();
    loss.backward();
    // Backward gathers every block's 4 parameters, and the root's 3 when it
    // freed them.
    EXPECT_EQ((dist::comm_stats() - before)[dist::OpType::kAllGather],
              kBlocks * kBlockParams + (raf ? kRootParams : 0));
  }
}

}  // namespace
}  // namespace hp
