// The performance features of fully_shard: comm_fusion with and without
// the zero-copy flat buffer, the number of collectives per step, prefetch,
// reshard_after_forward = N, mixed precision and the offload policy — each
// against plain libtorch in one process, with the bounds of
// gpt_training_test.cpp (the same arithmetic, reordered:
// tests/fsdp/data_parallel_reference.h derives them).
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "hp/distributed/comm_stats.h"
#include "hp/distributed/stream_ops.h"
#include "hp/fsdp/fsdp_param.h"
#include "hp/fsdp/registry.h"
#include "hp/fsdp/storage.h"
#include "hp/util/error.h"
#include "hp/util/format.h"
#include "hp/util/op_profile.h"
#include "hp/util/torch_compat.h"
#include "hp/util/trace.h"
#include "tests/fsdp/fsdp_test_util.h"
#include "tests/fsdp/gpt_fixture.h"
#include "tests/support/tensor_checks.h"

namespace hp {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::StrEq;
using ::testing::ThrowsMessage;

using test::kBatch;
using test::my_first_row;
using test::my_rows;

void expect_training_matches(const FullyShardOptions& options) {
  test::expect_training_matches(options);
}

TEST(CommFusion, TrainingMatchesPlainLibtorchInEveryMode) {
  for (const auto& mesh : test::mesh_configs()) {
    for (bool zero_copy : {true, false}) {
      for (bool reshard : {true, false}) {
        SCOPED_TRACE(mesh.name + (zero_copy ? " zero-copy" : " copy-in") +
                     (reshard ? " reshard" : " keep"));
        FullyShardOptions options;
        options.mesh = test::make_mesh(mesh);
        options.comm_fusion = true;
        options.comm_fusion_zero_copy = zero_copy;
        options.reshard_after_forward = reshard;
        expect_training_matches(options);
      }
    }
  }
}

TEST(CommFusion, AtMostTwoAllGathersAndOneReduceScatterPerUnit) {
  for (const auto& mesh : test::mesh_configs()) {
    SCOPED_TRACE(mesh.name);
    auto model = test::make_gpt(7, /*layers=*/4);
    FullyShardOptions options;
    options.mesh = test::make_mesh(mesh);
    options.comm_fusion = true;
    test::shard_gpt(model, options);
    auto opt = test::make_adamw(*model);
    const int64_t units = 1 + 4;
    for (int step = 0; step < 2; ++step) {
      dist::reset_comm_stats();
      test::gpt_loss(model, test::token_batch(step), my_first_row(), my_rows()).backward();
      opt.step();
      opt.zero_grad();
      const dist::CommStats stats = dist::comm_stats();
      const bool sharded = dist::get_world_size() > 1 && mesh.name != "ddp";
      const bool replicas = mesh.name != "fsdp" && dist::get_world_size() > 1;
      EXPECT_LE(stats[dist::OpType::kAllGather], sharded ? 2 * units : 0) << "step " << step;
      EXPECT_LE(stats[dist::OpType::kReduceScatter], sharded ? units : 0) << "step " << step;
      EXPECT_LE(stats[dist::OpType::kAllReduce], replicas ? units : 0) << "step " << step;
      if (sharded) {
        EXPECT_GE(stats[dist::OpType::kReduceScatter], units);
      }
    }
  }
}

// The reduce-scatter input of a fused unit: on the streams (the GPU's
// schedule; here recorded under HP_TEST_STREAMS=record) every unit packs its
// sharded gradients with one _chunk_cat once the last arrived; on the host
// path each gradient is copied in as it arrives, except the root's, which
// wait for its last (its first arrive at the head, its last at the
// embeddings) and so are packed by one _chunk_cat too. The packed values are
// checked by the parity tests above, which run on both paths.
TEST(CommFusion, AUnitsGradientsArePackedByOneChunkCat) {
  if (dist::get_world_size() < 2) GTEST_SKIP() << "one rank reduce-scatters nothing";
#if !HP_TORCH_AT_LEAST(2, 4)
  GTEST_SKIP() << "libtorch before 2.4 has no _chunk_cat: one copy per gradient";
#else
  const bool on_streams = dist::stream_ops_for(c10::Device(c10::kCPU)).orders_by_streams();
  const int64_t layers = 3;
  auto model = test::make_gpt(7, layers);
  FullyShardOptions options;
  options.comm_fusion = true;
  test::shard_gpt(model, options);
  auto opt = test::make_adamw(*model);
  for (int step = 0; step < 2; ++step) {
    at::Tensor loss = test::gpt_loss(model, test::token_batch(step), my_first_row(), my_rows());
    OpProfile profile;
    profile.start();
    loss.backward();
    const OpProfileResult ops = profile.stop();
    double chunk_cats = 0;
    for (const OpStats& op : ops.ops) {
      if (op.name == "aten::_chunk_cat") chunk_cats += op.calls;
    }
    EXPECT_EQ(chunk_cats, on_streams ? 1 + layers : 1)
        << "step " << step << (on_streams ? " on the streams" : " on the host path");
    opt.step();
    opt.zero_grad();
  }
#endif
}

TEST(CommFusion, ZeroCopyShardsShareOneBuffer) {
  if (dist::get_world_size() < 2) GTEST_SKIP();
  for (bool zero_copy : {true, false}) {
    auto model = test::make_gpt();
    FullyShardOptions options;
    options.comm_fusion = true;
    options.comm_fusion_zero_copy = zero_copy;
    test::shard_gpt(model, options);
    nn::Block block = model->blocks()[0];
    // ln_1.weight and ln_1.bias: consecutive shards of one flat buffer.
    const at::Tensor& w = block->ln_1->weight;
    const at::Tensor& b = block->ln_1->bias;
    const int64_t chunk = (64 + dist::get_world_size() - 1) / dist::get_world_size();
    const auto distance = static_cast<char*>(b.data_ptr()) - static_cast<char*>(w.data_ptr());
    if (zero_copy) {
      EXPECT_EQ(distance, chunk * 4);
    } else {
      EXPECT_NE(distance, chunk * 4);
    }
  }
}

TEST(Prefetch, NextUnitIsGatheredBeforeItsForward) {
  if (dist::get_world_size() < 2) GTEST_SKIP();
  for (bool prefetch : {true, false}) {
    auto model = test::make_gpt();
    FSDPModule root = test::shard_gpt(model, {});
    root.set_implicit_prefetch(prefetch);
    nn::Block second = model->blocks()[1];
    // All-gathers issued by the block's own pre-forward hook: none when the
    // previous block prefetched it.
    int64_t before = 0, issued_by_own_hook = -1;
    second->register_forward_pre_hook(
        [&](nn::Module&, const nn::TensorList&) -> std::optional<nn::TensorList> {
          before = dist::comm_stats()[dist::OpType::kAllGather];
          return std::nullopt;
        },
        /*prepend=*/true);
    second->register_forward_pre_hook(
        [&](nn::Module&, const nn::TensorList&) -> std::optional<nn::TensorList> {
          issued_by_own_hook = dist::comm_stats()[dist::OpType::kAllGather] - before;
          return std::nullopt;
        });
    for (int step = 0; step < 2; ++step) {
      test::gpt_loss(model, test::token_batch(step), my_first_row(), my_rows()).backward();
    }
    // The second step knows the execution order; the block has 12 parameters.
    EXPECT_EQ(issued_by_own_hook, prefetch ? 0 : 12) << (prefetch ? "prefetch" : "no prefetch");
  }
}

TEST(Prefetch, ExplicitListsAndTrainingParity) {
  // Without the lists (and implicit prefetch off) each block gathers in its
  // own pre-forward: the count can tell the lists did something.
  for (bool lists : {true, false}) {
    SCOPED_TRACE(lists ? "explicit lists" : "no prefetch");
    auto reference = test::make_gpt();
    auto model = test::make_gpt();
    FullyShardOptions options;
    options.comm_fusion = true;
    FSDPModule root = test::shard_gpt(model, options);
    nn::Block b0 = model->blocks()[0], b1 = model->blocks()[1];
    FSDPModule u0(b0.ptr()), u1(b1.ptr());
    root.set_implicit_prefetch(false);
    if (lists) {
      root.set_modules_to_forward_prefetch({u0, u1});
      u0.set_modules_to_forward_prefetch({u1});
      u1.set_modules_to_backward_prefetch({u0});
    }
    auto own0 = test::count_own_all_gathers(b0), own1 = test::count_own_all_gathers(b1);
    at::Tensor tokens = test::token_batch(0, kBatch);
    at::Tensor ref_loss = test::reference_backward(reference, tokens, dist::get_world_size());
    at::Tensor loss = test::gpt_loss(model, tokens, my_first_row(), my_rows());
    loss.backward();
    EXPECT_TRUE(test::within_bound(test::world_mean(loss.item<double>()), ref_loss.item<double>(),
                                   test::loss_bound(ref_loss, dist::get_world_size())));
    // Fused: one all-gather per block, issued by the root's hook with lists.
    const int64_t expected = lists || dist::get_world_size() == 1 ? 0 : 1;
    EXPECT_EQ(*own0, expected) << "block 0";
    EXPECT_EQ(*own1, expected) << "block 1";
  }
}

TEST(ReshardAfterForwardInt, GathersWithinGroupsOfNRanks) {
  if (dist::get_world_size() != 4) GTEST_SKIP() << "needs 4 ranks for groups of 2";
  for (bool fused : {false, true}) {
    SCOPED_TRACE(fused ? "fused" : "per parameter");
    FullyShardOptions options;
    options.reshard_after_forward = int64_t{2};
    options.comm_fusion = fused;
    expect_training_matches(options);
    // After forward the block keeps half of each parameter (not a quarter);
    // backward's gathers run on the groups of 2.
    auto model = test::make_gpt();
    test::shard_gpt(model, options);
    const at::Tensor full_w = test::full_parameters(*model).at("h.0.mlp.c_fc.weight");
    trace::enable(dist::get_rank(), "test");
    at::Tensor loss = test::gpt_loss(model, test::token_batch(0), my_first_row(), my_rows());
    const at::Tensor& w = model->blocks()[0]->mlp->c_fc->weight;
    EXPECT_EQ(w.size(0), 256);
    EXPECT_FALSE(fsdp::storage_is_allocated(w));
    // The piece kept is rows [128 * (rank % 2), +128) of the 256: half.
    auto managed = fsdp::find_managed(w);
    ASSERT_TRUE(managed.has_value());
    const at::Tensor& piece = managed->param->regather_piece();
    ASSERT_TRUE(piece.defined());
    EXPECT_EQ(piece.numel(), 128 * 64);
    EXPECT_TRUE(test::tensors_equal(piece.reshape({128, 64}),
                                    full_w.narrow(0, 128 * (dist::get_rank() % 2), 128)));
    loss.backward();
    trace::disable();
    int regathers = 0;
    for (const auto& e : trace::events()) {
      if (e.lane.rfind("all_gather", 0) == 0 && e.name.find("fsdp-regather") != std::string::npos) {
        ++regathers;
      }
    }
    EXPECT_GE(regathers, 2) << "one per block at least";
  }
  EXPECT_THAT(
      [] {
        FullyShardOptions options;
        options.reshard_after_forward = int64_t{3};
        auto model = test::make_gpt();
        test::shard_gpt(model, options);
      },
      ThrowsMessage<ArgumentError>(HasSubstr(
          "reshard_after_forward as an int must be a divisor of the shard group size 4")));
}

TEST(MixedPrecision, Bf16ParamsWithFp32ReduceTrackFp32) {
  for (bool fused : {false, true}) {
    SCOPED_TRACE(fused ? "fused" : "per parameter");
    FullyShardOptions options;
    options.mp_policy.param_dtype = at::kBFloat16;
    options.mp_policy.reduce_dtype = at::kFloat;
    options.mp_policy.output_dtype = at::kFloat;
    options.comm_fusion = fused;
    // The reference runs each slice on a bf16 copy of its fp32 parameters
    // and sums the fp32 casts of the slices' gradients: the same bf16
    // arithmetic as each rank, so the fp32 reordering bounds apply.
    test::expect_training_matches(options, at::kBFloat16);
    // Compute happens in bf16; the optimizer sees fp32 shards and grads.
    auto model = test::make_gpt();
    test::shard_gpt(model, options);
    nn::Block block = model->blocks()[0];
    at::ScalarType seen = at::kFloat;
    block->register_forward_pre_hook([&](nn::Module&, const nn::TensorList& in)
                                         -> std::optional<nn::TensorList> {
      seen = block->mlp->c_fc->weight.scalar_type();
      EXPECT_EQ(in[0].scalar_type(), at::kBFloat16) << "cast_forward_inputs";
      return std::nullopt;
    });
    at::Tensor logits = model(test::token_batch(0).narrow(1, 0, 8));
    EXPECT_EQ(seen, at::kBFloat16);
    EXPECT_EQ(logits.scalar_type(), at::kFloat) << "output_dtype";
    logits.sum().backward();
    EXPECT_EQ(block->mlp->c_fc->weight.scalar_type(), at::kFloat);
    EXPECT_EQ(block->mlp->c_fc->weight.grad().scalar_type(), at::kFloat);
  }
}

TEST(MixedPrecision, MainGradsKeepTheReducedGradientsInFp32) {
  for (bool fused : {false, true}) {
    SCOPED_TRACE(fused ? "fused" : "per parameter");
    FullyShardOptions plain_options;
    plain_options.comm_fusion = fused;
    FullyShardOptions main_options = plain_options;
    main_options.mp_policy.apply_grad_on_fp32_main_grad = true;
    // fp32 parameters: over two backwards the main grads accumulate exactly
    // what .grad accumulates without the option, and .grad stays empty.
    auto plain = test::make_gpt();
    test::shard_gpt(plain, plain_options);
    auto model = test::make_gpt();
    FSDPModule root = test::shard_gpt(model, main_options);
    for (int step = 0; step < 2; ++step) {
      test::gpt_loss(plain, test::token_batch(step), my_first_row(), my_rows()).backward();
      test::gpt_loss(model, test::token_batch(step), my_first_row(), my_rows()).backward();
    }
    auto expected = plain->named_parameters();
    for (auto& item : model->named_parameters()) {
      EXPECT_FALSE(item.value().grad().defined()) << item.key();
      at::Tensor g = main_grad(item.value());
      ASSERT_TRUE(g.defined()) << item.key();
      EXPECT_EQ(g.scalar_type(), at::kFloat) << item.key();
      EXPECT_TRUE(test::tensors_equal(g, expected[item.key()].grad())) << item.key();
    }
    root.zero_grad();
    for (auto& p : model->parameters()) EXPECT_FALSE(main_grad(p).defined());

    // bf16 parameters reduced in fp32: the main grads keep the fp32 values
    // that .grad would get only rounded to bf16.
    FullyShardOptions low_plain_options = plain_options;
    low_plain_options.mp_policy.reduce_dtype = at::kFloat;
    FullyShardOptions low_main_options = main_options;
    low_main_options.mp_policy.reduce_dtype = at::kFloat;
    auto low_plain = test::make_gpt();
    low_plain->to(at::kBFloat16);
    test::shard_gpt(low_plain, low_plain_options);
    auto low = test::make_gpt();
    low->to(at::kBFloat16);
    test::shard_gpt(low, low_main_options);
    test::gpt_loss(low_plain, test::token_batch(0), my_first_row(), my_rows()).backward();
    test::gpt_loss(low, test::token_batch(0), my_first_row(), my_rows()).backward();
    auto low_expected = low_plain->named_parameters();
    for (auto& item : low->named_parameters()) {
      EXPECT_EQ(item.value().scalar_type(), at::kBFloat16) << item.key();
      EXPECT_FALSE(item.value().grad().defined()) << item.key();
      at::Tensor g = main_grad(item.value());
      ASSERT_TRUE(g.defined()) << item.key();
      EXPECT_EQ(g.scalar_type(), at::kFloat) << item.key();
      EXPECT_TRUE(test::tensors_equal(g.to(at::kBFloat16), low_expected[item.key()].grad()))
          << item.key();
    }
  }
  // Main grads in another dtype than fp32 are refused, as is a parameter
  // fully_shard does not manage.
  auto low = test::make_gpt();
  low->to(at::kBFloat16);
  FullyShardOptions options;
  options.mp_policy.apply_grad_on_fp32_main_grad = true;
  EXPECT_THAT([&] { fully_shard(low.ptr(), options); },
              ThrowsMessage<ArgumentError>(StrEq(
                  "MixedPrecisionPolicy.apply_grad_on_fp32_main_grad=true needs gradients reduced "
                  "in fp32 (set reduce_dtype to Float), but they are reduced in {BFloat16}")));
  EXPECT_THAT([&] { main_grad(at::zeros({2, 3})); },
              ThrowsMessage<ArgumentError>(
                  StrEq("main_grad: the parameter of shape [2, 3] is not managed by fully_shard")));
}

TEST(MixedPrecision, ValidationErrors) {
  FullyShardOptions options;
  options.mp_policy.param_dtype = at::kLong;
  EXPECT_THAT([&] { fully_shard(test::make_gpt().ptr(), options); },
              ThrowsMessage<ArgumentError>(StrEq(
                  "MixedPrecisionPolicy.param_dtype must be a floating-point dtype, got Long")));
  auto model = test::make_gpt();
  model->lm_head->weight.set_data(model->lm_head->weight.to(at::kDouble));
  EXPECT_THAT([&] { fully_shard(model.ptr()); },
              ThrowsMessage<ArgumentError>(
                  StrEq("FSDP expects uniform original parameter dtype but got {Float, Double}")));
}

TEST(CommFusionErrors, ZeroCopyWithoutFusionNamesTheReasonAndTheAlternative) {
  FullyShardOptions options;
  options.comm_fusion_zero_copy = true;
  auto model = test::make_gpt();
  dist::reset_comm_stats();
  // Unset comm_fusion is off for CPU parameters: refused after the device
  // is known, saying so; an explicit false is refused up front.
  EXPECT_THAT(
      [&] { fully_shard(model.ptr(), options); },
      ThrowsMessage<ArgumentError>(AllOf(
          HasSubstr("comm_fusion_zero_copy=true needs comm_fusion=true, but comm_fusion is unset "
                    "and off for these parameters"),
          HasSubstr("flat all-gather input buffer, which only comm_fusion builds"),
          HasSubstr("set comm_fusion=true"))));
  options.comm_fusion = false;
  EXPECT_THAT(
      [&] { fully_shard(model.ptr(), options); },
      ThrowsMessage<ArgumentError>(
          HasSubstr("comm_fusion_zero_copy=true needs comm_fusion=true, but comm_fusion is false")));
  // Refused before any collective, the model as it was.
  EXPECT_EQ(dist::comm_stats().total(), 0);
  EXPECT_FALSE(is_fully_sharded(*model));
  EXPECT_EQ(model->lm_head->weight.sizes().vec(), (std::vector<int64_t>{50, 64}));
  // Unset, or false, is the per-parameter path.
  options.comm_fusion_zero_copy = false;
  EXPECT_NO_THROW(fully_shard(model.ptr(), options));
}

// Whole parameters beside fused shards: the shards' reduce-scatter and the
// whole parameters' one all-reduce over the mesh reduce the same terms as
// the reference, in another order, so the bounds of expect_training_matches
// (reordered_sum_bound of the recorded terms; AdamWBound after the step)
// apply unchanged. 3 ranks make uneven shards beside them.
TEST(ReplicateParams, FusedTrainingMatchesPlainLibtorchInEveryMode) {
  for (const auto& mesh : test::mesh_configs()) {
    for (bool zero_copy : {true, false}) {
      SCOPED_TRACE(mesh.name + (zero_copy ? " zero-copy" : " copy-in"));
      FullyShardOptions options;
      options.mesh = test::make_mesh(mesh);
      options.comm_fusion = true;
      options.comm_fusion_zero_copy = zero_copy;
      test::expect_training_matches(options, {}, test::kReplicatedGptParams);
    }
    // bf16 compute, fp32 reduction: the whole parameters' bucket is fp32.
    // The reference runs each slice on a bf16 copy and sums the fp32 casts
    // of the slices' gradients, as in MixedPrecision.Bf16ParamsWithFp32-
    // ReduceTrackFp32, so the fp32 reordering bounds apply.
    SCOPED_TRACE(mesh.name + " bf16 compute, fp32 reduce");
    FullyShardOptions options;
    options.mesh = test::make_mesh(mesh);
    options.comm_fusion = true;
    options.mp_policy.param_dtype = at::kBFloat16;
    options.mp_policy.reduce_dtype = at::kFloat;
    options.mp_policy.output_dtype = at::kFloat;
    test::expect_training_matches(options, at::kBFloat16, test::kReplicatedGptParams);
  }
}

// Per backward, each unit that holds whole parameters all-reduces them in
// one collective over every rank of the mesh; the sharded ones keep one
// reduce-scatter per unit (and, HSDP, one all-reduce over the replicas).
// With zero-copy the whole parameters keep tensors of their own, outside
// the flat shard buffer.
TEST(CommFusion, OneAllReduceOverTheMeshPerUnitForItsWholeParameters) {
  if (dist::get_world_size() < 2) GTEST_SKIP();
  for (const auto& mesh : test::mesh_configs()) {
    SCOPED_TRACE(mesh.name);
    auto model = test::make_gpt(7, /*layers=*/4);
    FullyShardOptions options;
    options.mesh = test::make_mesh(mesh);
    options.comm_fusion = true;
    // Whole parameters in the root's unit and in blocks 0 and 2.
    const std::vector<std::string> whole = {"ln_f.weight", "h.0.attn.c_attn.bias",
                                            "h.2.mlp.c_fc.weight", "h.2.ln_1.bias"};
    test::shard_gpt(model, options, whole);
    const nn::Block block2 = model->blocks()[2];
    EXPECT_EQ(block2->mlp->c_fc->weight.sizes().vec(), (std::vector<int64_t>{256, 64}));
    EXPECT_FALSE(block2->mlp->c_fc->weight.is_alias_of(block2->ln_1->weight));
    const int64_t units = 1 + 4;
    const bool ddp = mesh.name == "ddp", hsdp = mesh.name == "hsdp";
    // Under DDP no parameter is sharded: every unit's are whole.
    const int64_t with_whole = ddp ? units : 3;
    const std::string whole_mesh = "ranks " + to_string(options.mesh->ranks());
    auto opt = test::make_adamw(*model);
    for (int step = 0; step < 2; ++step) {
      dist::reset_comm_stats();
      trace::enable(dist::get_rank(), "test");
      test::gpt_loss(model, test::token_batch(step), my_first_row(), my_rows()).backward();
      trace::disable();
      int64_t over_mesh = 0;
      for (const auto& e : trace::events()) {
        if (e.lane == "all_reduce" && e.name.find(whole_mesh) != std::string::npos) ++over_mesh;
      }
      const dist::CommStats stats = dist::comm_stats();
      EXPECT_EQ(over_mesh, with_whole) << "step " << step;
      EXPECT_EQ(stats[dist::OpType::kAllReduce], with_whole + (hsdp ? units : 0))
          << "step " << step;
      EXPECT_EQ(stats[dist::OpType::kReduceScatter], ddp ? 0 : units) << "step " << step;
      opt.step();
      opt.zero_grad();
    }
  }
}

TEST(OffloadPolicy, AcceptedAsANoOpOnCpu) {
  for (bool pin : {true, false}) {
    FullyShardOptions options;
    options.offload_policy = OffloadPolicy::cpu(pin);
    expect_training_matches(options);
  }
}

}  // namespace
}  // namespace hp
