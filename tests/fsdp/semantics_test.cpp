// fully_shard semantics around the training loop that the other files leave
// out: wait_for_gradients() after set_is_last_backward(false) (F10),
// set_reduce_op_type and set_requires_all_reduce on one unit, comm_fusion
// with no-sync micro-batches and after load_state_dict (F12), the pipeline
// of fused reductions seen in the trace (F12, A3), each unit's compute
// marked on the compute stream for the trace's GPU lanes, mesh-less fully_shard
// over tensor-parallel parameters (F16), and the errors of lazy init, fused
// dtypes and replicate_params.
//
// Tolerances: none is a constant. As in gpt_training_test.cpp, each rank
// computes its slice bit for bit as the single-process reference does, so
// gradients may differ only by the order their terms are added in:
// reordered_sum_bound of the terms the reference recorded
// (tests/fsdp/data_parallel_reference.h derives them); values that are
// only copied (gathered, loaded) are compared exactly.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "hp/distributed/comm_stats.h"
#include "hp/distributed/recording_stream_ops.h"
#include "hp/distributed/stream_ops.h"
#include "hp/fsdp/fsdp_param.h"
#include "hp/fsdp/registry.h"
#include "hp/tensor/dtensor_tensor.h"
#include "hp/tp/shard_module.h"
#include "hp/util/error.h"
#include "hp/util/gpu_trace.h"
#include "hp/util/trace.h"
#include "tests/support/clock_gpu_mark.h"
#include "tests/fsdp/fsdp_test_util.h"
#include "tests/fsdp/gpt_fixture.h"
#include "tests/fsdp/toy_model.h"
#include "tests/support/tensor_checks.h"
#include "tests/tp/tp_mlp.h"

namespace hp {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::StrEq;
using ::testing::ThrowsMessage;
using test::kBatch;
using test::my_first_row;
using test::my_rows;

int64_t world() { return dist::get_world_size(); }

// Whether no collective was issued since the last reset_comm_stats().
bool nothing_communicated() {
  const dist::CommStats s = dist::comm_stats();
  return s[dist::OpType::kAllGather] == 0 && s[dist::OpType::kReduceScatter] == 0 &&
         s[dist::OpType::kAllReduce] == 0;
}

// --- wait_for_gradients --------------------------------------------------

TEST(WaitForGradients, CompletesPendingReductionsLikeOneProcess) {
  for (const auto& mesh : test::mesh_configs()) {
    for (bool fused : {false, true}) {
      SCOPED_TRACE(mesh.name + (fused ? " fused" : " per parameter"));
      auto reference = test::make_gpt();
      auto model = test::make_gpt();
      FullyShardOptions options;
      options.mesh = test::make_mesh(mesh);
      options.comm_fusion = fused;
      FSDPModule root = test::shard_gpt(model, options);
      // Before any forward nothing is pending: nothing to wait for.
      dist::reset_comm_stats();
      root.wait_for_gradients();
      EXPECT_TRUE(nothing_communicated());

      root.set_is_last_backward(false);
      at::Tensor tokens = test::token_batch(0);
      test::reference_backward(reference, tokens, world());
      test::gpt_loss(model, tokens, my_first_row(), my_rows()).backward();
      // The root's reductions are issued last and still pending: its
      // parameters have no gradient yet.
      EXPECT_FALSE(model->wte->weight.grad().defined());
      root.wait_for_gradients();
      for (auto& item : model->named_parameters()) {
        EXPECT_TRUE(item.value().grad().defined()) << item.key();
      }
      test::expect_gradients_match(model, reference);
      // Nothing is left: a second call communicates nothing.
      dist::reset_comm_stats();
      root.wait_for_gradients();
      EXPECT_TRUE(nothing_communicated());
      root.set_is_last_backward(true);
    }
  }
}

TEST(WaitForGradients, ThroughAnInnerUnitCompletesTheWholeTree) {
  auto reference = test::make_gpt();
  auto model = test::make_gpt();
  FSDPModule root = test::shard_gpt(model, {});
  nn::Block block = model->blocks()[1];
  FSDPModule inner(block.ptr());
  inner.set_is_last_backward(false);
  at::Tensor tokens = test::token_batch(0);
  test::reference_backward(reference, tokens, world());
  test::gpt_loss(model, tokens, my_first_row(), my_rows()).backward();
  EXPECT_FALSE(model->wte->weight.grad().defined());
  inner.wait_for_gradients();  // the root's reductions too
  test::expect_gradients_match(model, reference);
}

TEST(WaitForGradients, CompletesMainGrads) {
  for (bool fused : {false, true}) {
    SCOPED_TRACE(fused ? "fused" : "per parameter");
    auto reference = test::make_gpt();
    auto model = test::make_gpt();
    FullyShardOptions options;
    options.comm_fusion = fused;
    options.mp_policy.apply_grad_on_fp32_main_grad = true;
    FSDPModule root = test::shard_gpt(model, options);
    root.set_is_last_backward(false);
    at::Tensor tokens = test::token_batch(0);
    test::reference_backward(reference, tokens, world());
    test::gpt_loss(model, tokens, my_first_row(), my_rows()).backward();
    EXPECT_FALSE(main_grad(model->wte->weight).defined());
    root.wait_for_gradients();
    std::map<std::string, at::Tensor> grads;
    for (auto& item : model->named_parameters()) {
      EXPECT_FALSE(item.value().grad().defined()) << item.key();
      grads[item.key()] = main_grad(item.value());
    }
    test::expect_gradient_shards_within(model, reference, grads,
                                        test::gradient_bounds(reference));
  }
}

TEST(WaitForGradients, RefusedDuringABackward) {
  auto model = test::make_gpt();
  FSDPModule root = test::shard_gpt(model, {});
  root.set_is_last_backward(false);
  // Called from a hook on block 0's output gradient, which runs after the
  // root and block 1 started their backward.
  std::string message;
  nn::Block block = model->blocks()[0];
  block->register_forward_hook(
      [&](nn::Module&, const nn::TensorList&, const nn::TensorList& outputs)
          -> std::optional<nn::TensorList> {
        outputs[0].register_hook([&](const at::Tensor&) {
          try {
            root.wait_for_gradients();
          } catch (const ArgumentError& e) {
            message = e.what();
          }
        });
        return std::nullopt;
      });
  test::gpt_loss(model, test::token_batch(0), my_first_row(), my_rows()).backward();
  EXPECT_THAT(message, HasSubstr("wait_for_gradients: called during a backward of the units of "
                                 "GPT; expected a call after backward() returns"));
  root.wait_for_gradients();  // after it, fine
  for (auto& p : model->parameters()) EXPECT_TRUE(p.grad().defined());
}

// --- reduce op and all-reduce on one unit ---------------------------------

TEST(SetReduceOpType, NonRecursiveChangesOnlyThatUnit) {
  auto reference = test::make_gpt();
  auto model = test::make_gpt();
  FSDPModule root = test::shard_gpt(model, {});
  root.set_reduce_op_type("sum", /*recurse=*/false);
  at::Tensor tokens = test::token_batch(0);
  test::reference_backward(reference, tokens, world());
  test::gpt_loss(model, tokens, my_first_row(), my_rows()).backward();
  // The root's own parameters are summed, the blocks' still averaged: each
  // shard against the reference's gradient times dp or 1, within the bound
  // its terms allow at that scale (as GPTFullyShard.SumIsAverageTimesData-
  // ParallelSize derives it).
  auto ref = reference->named_parameters();
  auto mine = model->named_parameters();
  const auto avg_bounds = test::gradient_bounds(reference);
  const auto sum_bounds = test::gradient_bounds(reference, world());
  int summed = 0, averaged = 0;
  for (auto& [name, value] : root.state_dict()) {
    const Layout& layout = std::get<DTensor>(value).layout();
    const bool in_block = name.rfind("h.", 0) == 0;
    (in_block ? averaged : summed) += 1;
    const double scale = in_block ? 1.0 : static_cast<double>(world());
    at::Tensor expected = distribute_tensor(ref[name].grad() * scale, layout).local();
    at::Tensor bound =
        distribute_tensor((in_block ? avg_bounds : sum_bounds).at(name), layout).local();
    ASSERT_TRUE(mine[name].grad().defined()) << name;
    EXPECT_TRUE(test::within_bound(mine[name].grad(), expected, bound)) << name;
  }
  EXPECT_GT(summed, 0);
  EXPECT_GT(averaged, 0);
}

TEST(SetRequiresAllReduce, NonRecursiveChangesOnlyThatUnit) {
  for (const auto& mesh : test::mesh_configs()) {
    if (mesh.name == "fsdp") continue;  // no replicas: nothing to skip
    SCOPED_TRACE(mesh.name);
    auto reference = test::make_gpt();
    auto model = test::make_gpt();
    FullyShardOptions options;
    options.mesh = test::make_mesh(mesh);
    FSDPModule root = test::shard_gpt(model, options);
    at::Tensor tokens = test::token_batch(0);
    test::reference_backward(reference, tokens, world());
    root.set_requires_all_reduce(false, /*recurse=*/false);
    test::gpt_loss(model, tokens, my_first_row(), my_rows()).backward();
    // The root keeps its replicas' partial sums aside (no .grad yet); the
    // blocks all-reduced theirs.
    auto ref = reference->named_parameters();
    for (auto& item : model->named_parameters()) {
      const bool in_block = item.key().rfind("h.", 0) == 0;
      EXPECT_EQ(item.value().grad().defined(), in_block) << item.key();
    }
    // The next backward with the all-reduce adds the kept sums in.
    tokens = test::token_batch(1);
    test::reference_backward(reference, tokens, world());
    root.set_requires_all_reduce(true, /*recurse=*/false);
    test::gpt_loss(model, tokens, my_first_row(), my_rows()).backward();
    test::expect_gradients_match(model, reference);
  }
}

// --- comm_fusion ------------------------------------------------------------

TEST(CommFusion, NoSyncMicroBatchesEqualOneBigBatch) {
  for (const auto& mesh : test::mesh_configs()) {
    for (bool reshard_after_backward : {true, false}) {
      SCOPED_TRACE(mesh.name + (reshard_after_backward ? "" : " kept gathered"));
      auto reference = test::make_gpt();
      auto ref_opt = test::make_adamw(*reference);
      auto model = test::make_gpt();
      FullyShardOptions options;
      options.mesh = test::make_mesh(mesh);
      options.comm_fusion = true;
      FSDPModule root = test::shard_gpt(model, options);
      auto opt = test::make_adamw(*model);
      // The global batch of 4 * 12 rows in one go, and as 4 micro-batches,
      // each rank its own slice of each; only the last synchronises. The
      // loss / 4 scales exactly, so the two differ only by the order of the
      // same terms (as in GPTFullyShard.AccumulationWithoutSyncEqualsOne-
      // BigBatch).
      at::Tensor tokens = at::cat({test::token_batch(0), test::token_batch(1),
                                   test::token_batch(2), test::token_batch(3)});
      test::reference_backward(reference, tokens, 4 * world());
      for (int micro = 0; micro < 4; ++micro) {
        const bool last = micro == 3;
        root.set_requires_gradient_sync(last);
        root.set_reshard_after_backward(last || reshard_after_backward);
        at::Tensor loss = test::gpt_loss(model, tokens, micro * kBatch + my_first_row(), my_rows());
        (loss / 4).backward();
        if (!last) {
          for (auto& p : model->parameters()) EXPECT_FALSE(p.grad().defined());
        }
      }
      auto bounds = test::expect_gradients_match(model, reference);
      test::AdamWBound adam(test::adamw_hyper());
      test::step_and_expect_parameters_match(model, reference, opt, ref_opt, adam, bounds);
    }
  }
}

// The first two block parameters' shards are consecutive in the unit's flat
// buffer (zero-copy) and the gathered parameter is what the shards hold.
void expect_shards_in_flat_buffer(nn::GPT& model) {
  nn::Block block = model->blocks()[0];
  const at::Tensor& w = block->ln_1->weight;
  const at::Tensor& b = block->ln_1->bias;
  const int64_t chunk = (64 + world() - 1) / world();
  EXPECT_EQ(static_cast<char*>(b.data_ptr()) - static_cast<char*>(w.data_ptr()), chunk * 4);
}

TEST(CommFusion, ZeroCopyBufferHoldsLoadedValuesAndOptimizerUpdates) {
  if (world() < 2) GTEST_SKIP();
  FullyShardOptions options;
  options.comm_fusion = true;
  auto source = test::make_gpt(/*seed=*/1);
  FSDPModule source_root = test::shard_gpt(source, options);
  auto model = test::make_gpt(/*seed=*/2);
  FSDPModule root = test::shard_gpt(model, options);
  root.load_state_dict(source_root.state_dict());
  expect_shards_in_flat_buffer(model);
  // The loaded values are what forward gathers: the same loss as the source.
  at::Tensor tokens = test::token_batch(0);
  {
    at::NoGradGuard no_grad;
    EXPECT_EQ(test::gpt_loss(model, tokens, my_first_row(), my_rows()).item<double>(),
              test::gpt_loss(source, tokens, my_first_row(), my_rows()).item<double>());
  }
  // One AdamW step: the optimizer updates the shards in place, and the
  // next gather must see the updates (it reads the flat buffer).
  auto opt = test::make_adamw(*model);
  test::gpt_loss(model, tokens, my_first_row(), my_rows()).backward();
  opt.step();
  opt.zero_grad();
  expect_shards_in_flat_buffer(model);
  const auto stepped = test::full_parameters(*model);  // from the shards
  const auto loaded = test::full_parameters(*source);
  nn::Block block = model->blocks()[0];
  FSDPModule unit(block.ptr());
  unit.unshard();
  for (auto& item : block->named_parameters()) {
    const std::string name = "h.0." + item.key();
    SCOPED_TRACE(name);
    // A copy: exactly the stepped shards, which moved off the loaded values.
    EXPECT_TRUE(test::tensors_equal(item.value(), stepped.at(name)));
    EXPECT_FALSE(test::tensors_equal(item.value(), loaded.at(name)));
  }
  unit.reshard();
}

// Trace events of a lane prefix, in the order they were recorded.
std::vector<trace::Event> events_in(const std::vector<trace::Event>& all, const std::string& lane,
                                    const std::string& name_prefix = "") {
  std::vector<trace::Event> out;
  for (const auto& e : all) {
    if (e.lane.rfind(lane, 0) == 0 && e.name.rfind(name_prefix, 0) == 0) out.push_back(e);
  }
  return out;
}

// The position of `e` in the recorded order.
size_t position(const std::vector<trace::Event>& all, const trace::Event& e) {
  for (size_t i = 0; i < all.size(); ++i) {
    if (all[i].name == e.name && all[i].start_us == e.start_us && all[i].end_us == e.end_us &&
        all[i].lane == e.lane) {
      return i;
    }
  }
  return all.size();
}

// With comm_fusion the reductions of successive units form a pipeline: unit
// k's first stage is issued as its backward compute ends, each later stage
// when the next unit's compute has ended, and the gradients are applied
// when the last stage is waited for, one unit later still. FSDP's stages
// are [reduce-scatter], DDP's [all-reduce] (one rank per shard: nothing to
// scatter), HSDP's [reduce-scatter, all-reduce]. The trace records each
// unit's backward compute as it ends and each collective when it is waited
// for (its start: when it was issued), so the recorded order and the
// timestamps of one monotonic clock show each stage's place across units.
// Autograd may start a unit's compute before the previous unit's last
// gradient arrived, so only the ends of compute order the units.
TEST(CommFusion, ReductionStagesFormAPipelineAcrossUnits) {
  for (const auto& mesh : test::mesh_configs()) {
    SCOPED_TRACE(mesh.name);
    const bool shards = mesh.shape.back() > 1, replicas = mesh.shape.size() == 2;
    auto model = test::make_gpt(7, /*layers=*/4);
    FullyShardOptions options;
    options.mesh = test::make_mesh(mesh);
    options.comm_fusion = true;
    test::shard_gpt(model, options);
    at::Tensor loss = test::gpt_loss(model, test::token_batch(0), my_first_row(), my_rows());
    trace::enable(dist::get_rank(), "test");
    loss.backward();
    trace::disable();
    const auto all = trace::events();
    const auto backward = events_in(all, "compute", "backward ");
    std::vector<std::vector<trace::Event>> stages;
    if (shards) stages.push_back(events_in(all, "reduce_scatter"));
    if (replicas) stages.push_back(events_in(all, "all_reduce"));
    // The 4 blocks, then the root (last: its embeddings' gradients come
    // last; its own reduction moves no other on, they complete at the end
    // of backward).
    const size_t n = backward.size();
    ASSERT_EQ(n, 5u);
    for (const auto& stage : stages) ASSERT_EQ(stage.size(), n);
    auto compute_end = [&](size_t unit) { return backward[std::min(unit, n - 1)].end_us; };
    auto compute_recorded = [&](size_t unit) {
      return position(all, backward[std::min(unit, n - 1)]);
    };
    for (size_t k = 0; k + 1 < n; ++k) {
      for (size_t j = 0; j < stages.size(); ++j) {
        SCOPED_TRACE("unit " + std::to_string(k) + " in backward order, stage " +
                     std::to_string(j));
        const trace::Event& e = stages[j][k];
        // Issued once unit k+j's compute ended, before unit k+j+1's did.
        EXPECT_GE(e.start_us, compute_end(k + j));
        if (k + j + 1 < n) {
          EXPECT_LE(e.start_us, compute_end(k + j + 1));
        }
        // Waited for (then the next stage issued, or the gradients applied)
        // once unit k+j+1's compute ended, before unit k+j+2's did.
        EXPECT_GT(position(all, e), compute_recorded(k + j + 1));
        if (k + j + 2 < n) {
          EXPECT_LT(position(all, e), compute_recorded(k + j + 2));
        }
      }
    }
  }
}

using test::ClockMark;  // fake GPU marks on a device clock

// The recording ops (the schedule a GPU runs), marking streams for the
// trace as CUDA's ops do.
class MarkingStreamOps final : public dist::RecordingStreamOps {
 public:
  std::shared_ptr<trace::GpuMark> trace_mark(dist::StreamRole stream) override {
    device_ms_ += 1.0;
    return std::make_shared<ClockMark>(device_ms_);
  }

 private:
  double device_ms_ = 0;
};

// On streams every unit's forward and backward compute is also marked on
// the compute stream: one GPU span beside each host span, of the same name,
// in the lane "gpu compute" (the host's lanes keep their spans).
TEST(Trace, EachUnitsComputeGetsAGpuSpanOnTheComputeStream) {
  auto ops = std::make_shared<MarkingStreamOps>();
  dist::ScopedStreamOps scope(ops);
  auto model = test::make_gpt(7, /*layers=*/2);
  FullyShardOptions options;
  options.mesh = test::make_mesh(test::mesh_configs().front());
  test::shard_gpt(model, options);
  trace::enable(dist::get_rank(), "test");
  trace::anchor_gpu(ops->trace_mark(dist::StreamRole::kCompute), trace::now_us());
  test::gpt_loss(model, test::token_batch(0), my_first_row(), my_rows()).backward();
  trace::disable();
  trace::resolve_gpu(/*wait=*/true);
  std::multiset<std::string> host, gpu;
  for (const trace::Event& e : trace::events()) {
    const bool compute = e.name.rfind("forward ", 0) == 0 || e.name.rfind("backward ", 0) == 0;
    if (compute && e.lane == "compute") host.insert(e.name);
    if (e.lane == "gpu compute") {
      gpu.insert(e.name);
      EXPECT_GT(e.end_us, e.start_us) << e.name << ": its own two marks";
    }
  }
  // The 2 blocks and the root, forward and backward.
  EXPECT_EQ(host.size(), 6u);
  EXPECT_EQ(gpu, host);
  EXPECT_EQ(trace::pending_gpu_spans(), 0u);
}

// A unit of two layers whose second only some ranks use in a step.
struct TwoPathsImpl : nn::Module {
  TwoPathsImpl() : nn::Module("TwoPaths") {
    a = register_module("a", torch::nn::Linear(6, 10));
    b = register_module("b", torch::nn::Linear(6, 10));
  }
  at::Tensor forward(const at::Tensor& x) { return use_b ? a(x) + b(x) : a(x); }
  torch::nn::Linear a{nullptr}, b{nullptr};
  bool use_b = true;
};
HP_MODULE(TwoPaths);

// A parameter that got no gradient on a rank reduces as zeros from there
// with comm_fusion, whose packed buffer is not zeroed up front: only rank
// 0 uses `b`, so the rows of b that rank 0 keeps get rank 0's gradient
// alone over the world size. The buffers freed just before backward hold
// NaN, so a block left unwritten would show. (The other ranks had no
// gradient of b, so their .grad of it stays untouched, reduction.h: only
// rank 0's rows of b, as rank 0 sees them, are checked.) Checked through one SGD step of lr 1
// (p - grad): the reference computes rank 0's gradient bit for bit (same
// rows, same kernels), and the run differs from it by at most the rounding
// of the average's division and of the subtraction, each half an ulp of its
// result (|p| + |grad| bounds both), and adding the other ranks' exact
// zeros.
TEST(CommFusion, AParameterWithoutAGradientOnSomeRanksReducesAsZeros) {
  const int64_t w = world(), r = dist::get_rank();
  auto [inputs, targets] = test::global_batch(0, 4 * w);
  for (const auto& mesh : test::mesh_configs()) {
    {
      SCOPED_TRACE(mesh.name);
      torch::manual_seed(7);
      TwoPaths reference;
      torch::manual_seed(7);
      TwoPaths model;
      FullyShardOptions options;
      options.mesh = test::make_mesh(mesh);
      options.comm_fusion = true;
      fully_shard(model.ptr(), options);
      // Rank 0's gradient of b, and the mean of the ranks' gradients of a.
      at::Tensor b_grad_w, b_grad_b;
      {
        reference->use_b = true;
        reference->zero_grad();
        reference(test::rows_for(inputs, 0, w)).sum().backward();
        b_grad_w = reference->b->weight.grad().clone();
        b_grad_b = reference->b->bias.grad().clone();
      }
      model->use_b = r == 0;
      at::Tensor loss = model(test::rows_for(inputs, r, w)).sum();
      for (int i = 0; i < 8; ++i) at::full({4 * 1024}, NAN);  // freed memory holds NaN
      loss.backward();
      torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(1.0));
      sgd.step();
      const auto after = test::full_parameters(*model);  // collective
      if (r != 0) continue;
      const float ulp = std::ldexp(1.0f, -23);
      for (const auto& [name, grad] : {std::pair<std::string, at::Tensor>{"b.weight", b_grad_w},
                                        {"b.bias", b_grad_b}}) {
        // Rank 0's rows: all of them when the shard dim has one rank.
        const int64_t ranks = mesh.shape.back();
        const int64_t rows = (grad.size(0) + ranks - 1) / ranks;
        const at::Tensor before =
            (name == "b.weight" ? reference->b->weight : reference->b->bias).narrow(0, 0, rows);
        const at::Tensor g = grad.narrow(0, 0, rows);
        const at::Tensor expected = before - g / static_cast<double>(w);
        const at::Tensor bound = ulp * (before.abs() + g.abs());
        const at::Tensor error = (after.at(name).narrow(0, 0, rows) - expected).abs();
        EXPECT_TRUE(at::all(error <= bound).item<bool>())
            << name << ": largest error " << error.max().item<float>() << " against a bound of "
            << bound.max().item<float>();
      }
    }
  }
}

// --- errors -----------------------------------------------------------------

TEST(FullyShardErrors, LazyInitRefusesAUnitInTheMiddleOfAnotherRootsStep) {
  auto reference = test::make_toy_model();
  auto model = test::make_toy_model();
  for (auto& block : model->block_list) fully_shard(block.ptr());
  fully_shard(model.ptr());
  // Block 0 run on its own becomes a root, and is between its forward and
  // its backward when the model's forward starts.
  at::Tensor x = torch::randn({2, 10});
  at::Tensor out = model->block_list[0](x);
  EXPECT_THAT([&] { model(torch::randn({2, 6})); },
              ThrowsMessage<ArgumentError>(StrEq(
                  "fully_shard: unit ToyBlock is in the middle of a forward/backward pass of "
                  "another root; run the outermost module's forward instead")));
  // Nothing changed: block 0's step finishes, and the model then trains like
  // the reference.
  out.sum().backward();
  FSDPModule(model.ptr()).zero_grad();
  const auto batch = test::global_batch(0);
  const at::Tensor& xs = batch.first;
  const at::Tensor& ys = batch.second;
  test::data_parallel_backward(
      reference->parameters(), reference->parameters(), world(), [&](int64_t part) {
        return torch::mse_loss(reference(test::rows_for(xs, part, world())),
                               test::rows_for(ys, part, world()));
      });
  torch::mse_loss(model(test::rows_for(xs, dist::get_rank(), world())),
                  test::rows_for(ys, dist::get_rank(), world()))
      .backward();
  test::expect_gradients_match(model, reference);
}

TEST(FullyShardErrors, FusionNeedsOneDtypeAndReplicateParamsMustBeParameters) {
  // A frozen parameter in another dtype: the parameters that train agree,
  // so only the fused buffers (one per unit) refuse it.
  auto model = test::make_toy_model();
  model->head->weight.set_data(model->head->weight.detach().to(at::kDouble));
  model->head->weight.set_requires_grad(false);
  FullyShardOptions options;
  options.comm_fusion = true;
  EXPECT_THAT([&] { fully_shard(model.ptr(), options); },
              ThrowsMessage<ArgumentError>(StrEq(
                  "comm_fusion: All parameters in the group must have a uniform dtype, got "
                  "{Float, Double}")));
  EXPECT_FALSE(is_fully_sharded(*model));
  options.comm_fusion = false;  // the per-parameter path takes it
  fully_shard(model.ptr(), options);
  EXPECT_TRUE(is_fully_sharded(*model));

  auto toy = test::make_toy_model();
  auto other = test::make_toy_model();
  options = {};
  options.replicate_params = {toy->head->weight, other->embed->weight};
  EXPECT_THAT([&] { fully_shard(toy.ptr(), options); },
              ThrowsMessage<ArgumentError>(StrEq(
                  "fully_shard: replicate_params contains a tensor of shape [10, 6] that is not a "
                  "parameter of the module(s) being sharded")));
  EXPECT_FALSE(is_fully_sharded(*toy));
}

// --- tensor-parallel parameters without a mesh ----------------------------

ShardingPlan mlp_plan() {
  ShardingPlan plan;
  plan.plan = {{"fc1.weight", {Shard(0)}},
               {"fc1.bias", {Shard(0)}},
               {"fc2.weight", {Shard(1)}},
               {"fc2.bias", {Replicate()}}};
  return plan;
}

TEST(FullyShardErrors, MeshlessOverTensorParallelParametersNamesTheCallToMake) {
  const std::string w = std::to_string(world());
  // A 1-D tensor-parallel mesh: the alternative is a mesh with a size-1
  // data-parallel dim.
  auto tp = init_device_mesh("cpu", {world()}, {"tp"});
  test::TpMlp model = test::make_tp_mlp();
  shard_module(model, tp, mlp_plan());
  EXPECT_THAT(
      [&] { fully_shard(model.ptr()); },
      ThrowsMessage<ArgumentError>(AllOf(
          HasSubstr("fully_shard: parameter 'fc1.weight' is a DTensor on DeviceMesh('cpu', "
                    "shape [" + w + "]"),
          HasSubstr("and options.mesh is not set; expected options.mesh, a data-parallel "
                    "sub-mesh of the mesh the parameter's was taken from"),
          HasSubstr("auto mesh = hp::init_device_mesh(\"cpu\", {1, " + w +
                    "}, {\"dp\", \"tp\"}); shard_module over mesh[\"tp\"], then options.mesh = "
                    "mesh[\"dp\"]"))));
  EXPECT_FALSE(is_fully_sharded(*model));

  // What it says to do works, and trains like tensor parallelism alone.
  auto mesh = init_device_mesh("cpu", {1, world()}, {"dp", "tp"});
  test::TpMlp fixed = test::make_tp_mlp();
  shard_module(fixed, (*mesh)["tp"], mlp_plan());
  // A mesh with the data-parallel dim: the message names that dim.
  EXPECT_THAT([&] { fully_shard(fixed.ptr()); },
              ThrowsMessage<ArgumentError>(HasSubstr(
                  "Pass options.mesh = mesh[\"dp\"], where mesh is DeviceMesh('cpu', shape [1, " +
                  w + "]")));
  FullyShardOptions options;
  options.mesh = (*mesh)["dp"];
  fully_shard(fixed.ptr(), options);
  EXPECT_TRUE(is_fully_sharded(*fixed));
  test::TpMlp plain = test::make_tp_mlp();
  shard_module(plain, tp, mlp_plan());
  torch::manual_seed(3);
  const at::Tensor x = torch::randn({5, 6});
  // One data-parallel rank: fully_shard only gathers (copies) and reduces
  // over one rank, so the outputs are equal.
  EXPECT_TRUE(test::tensors_equal(full_tensor(fixed(x)), full_tensor(plain(x))));
}

}  // namespace
}  // namespace hp
