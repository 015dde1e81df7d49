// Tensor parallelism under fully_shard (F16): the GPT's tensor-parallel plan
// over mesh["tp"], then fully_shard over mesh["dp"] of one (dp, tp) mesh,
// against one process, on every (dp, tp) that multiplies to the world size
// (on 4 ranks 1x4, 2x2, 4x1; on 3 ranks the uneven 3x1 and 1x3).
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>

#include "hp/distributed/world.h"
#include "hp/fsdp/clip_grad.h"
#include "hp/fsdp/fsdp_param.h"
#include "hp/fsdp/fully_shard.h"
#include "hp/fsdp/registry.h"
#include "hp/nn/gpt.h"
#include "hp/nn/loss.h"
#include "hp/tensor/dtensor_tensor.h"
#include "hp/tp/gpt_plan.h"
#include "hp/tp/shard_module.h"
#include "hp/tp/value_and_grad.h"
#include "hp/util/error.h"
#include "tests/nn/gpt_sensitivity.h"
#include "tests/support/rounding_bounds.h"
#include "tests/tp/tp_test_util.h"

namespace hp {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::ThrowsMessage;

// Every (dp, tp) with dp * tp = world size.
std::vector<std::pair<int64_t, int64_t>> mesh_shapes() {
  const int64_t n = dist::get_world_size();
  std::vector<std::pair<int64_t, int64_t>> shapes;
  for (int64_t dp = 1; dp <= n; ++dp) {
    if (n % dp == 0) shapes.emplace_back(dp, n / dp);
  }
  return shapes;
}

// Tensor parallel over mesh["tp"], then every block and the root a
// fully_shard unit over mesh["dp"].
FSDPModule parallelize(nn::GPT& model, const DeviceMeshPtr& mesh, FullyShardOptions options) {
  shard_module(model, (*mesh)["tp"], gpt_tensor_parallel_plan(model->config(), *(*mesh)["tp"]));
  options.mesh = (*mesh)["dp"];
  for (const nn::Block& block : model->blocks()) fully_shard(block.ptr(), options);
  return fully_shard(model.ptr(), options);
}

// The one-process reference and a model with the same (noisy) parameters,
// both in double, the model parallelized over `mesh` as above.
struct ReferenceAndModel {
  nn::GPT reference, model;
};
ReferenceAndModel reference_and_model(const nn::GPTConfig& config, const DeviceMeshPtr& mesh,
                                      FullyShardOptions options = {}) {
  ReferenceAndModel out{test::noisy_gpt(config, at::kDouble),
                        test::noisy_gpt(config, at::kDouble)};
  parallelize(out.model, mesh, std::move(options));
  return out;
}

// The global value of what a managed parameter (or its .grad) holds between
// steps: a DTensor is gathered; a plain shard through its unit's layout.
at::Tensor global_value(const at::Tensor& param, const at::Tensor& value) {
  torch::NoGradGuard no_grad;
  if (is_dtensor(value)) return full_tensor(value);
  auto managed = fsdp::find_managed(param);
  if (!managed) return value.detach();
  const fsdp::FSDPParam& p = *managed->param;
  return from_local(value.detach(), p.shard_layout(), {p.global_shape()}).full_tensor();
}

// The parameters' layouts: on a 2-D mesh each keeps its tensor-parallel
// placement over "tp" and gains fully_shard's over "dp", on a dim tensor
// parallelism left whole; the column-parallel biases (no dim left) are
// replicated over "dp".
TEST(GptFsdpTp, ParametersGetTwoDimensionalLayouts) {
  const nn::GPTConfig config = test::tp_small_config();
  for (auto [dp, tp] : mesh_shapes()) {
    if (dp == 1 || tp == 1) continue;
    SCOPED_TRACE(fmt::format("mesh {}x{}", dp, tp));
    auto mesh = init_device_mesh("cpu", {dp, tp}, {"dp", "tp"});
    nn::GPT model = test::noisy_gpt(config, at::kDouble);
    parallelize(model, mesh, {});
    auto params = model->named_parameters();
    auto placements = [&](const std::string& name) {
      EXPECT_TRUE(is_dtensor(params[name])) << name;
      EXPECT_EQ(layout_of(params[name]).mesh()->dim_names(),
                (std::vector<std::string>{"dp", "tp"}));
      return layout_of(params[name]).placements();
    };
    EXPECT_EQ(placements("h.0.attn.c_attn.weight"), (Placements{Shard(1), StridedShard(0, 3)}));
    EXPECT_EQ(placements("h.0.attn.c_attn.bias"), (Placements{Replicate(), StridedShard(0, 3)}));
    EXPECT_EQ(placements("h.0.attn.c_proj.weight"), (Placements{Shard(0), Shard(1)}));
    EXPECT_EQ(placements("h.0.mlp.c_fc.weight"), (Placements{Shard(1), Shard(0)}));
    EXPECT_EQ(placements("h.0.mlp.c_fc.bias"), (Placements{Replicate(), Shard(0)}));
    EXPECT_EQ(placements("h.0.ln_1.weight"), (Placements{Shard(0), Replicate()}));
    EXPECT_EQ(placements("wte.weight"), (Placements{Shard(1), Shard(0)}));
  }
}

// Three AdamW steps against one process on the whole batch, in float64,
// with comm_fusion off and on. Each dp rank runs its slice of the batch;
// tensor parallelism splits the row-parallel, vocabulary and replicated
// parameters' sums into per-rank partial sums (tests/tp/gpt_tp_test.cpp),
// and data parallelism splits the weight gradients' sums over the B*T
// tokens into per-dp-rank sums added by reduce-scatter: reorderings of the
// same terms, so every gradient stays within 4 n_max u S (S measured on the
// reference, tests/nn/gpt_sensitivity.h). Averaging over dp divides twice
// (by the local token count, then by dp) where the reference divides once:
// one more rounding of at most u |g| <= u S, covered by counting one more
// term in n_max. The logits of this rank's slice are the reference's rows
// within the same bound; the parameters after AdamW within what AdamWBound
// derives from the gradient bounds.
TEST(GptFsdpTp, TrainsLikeOneProcess) {
  const nn::GPTConfig config = test::tp_small_config();
  const test::AdamWHyper hyper{1e-3, 0.9, 0.95, 1e-8, 0.1};
  auto adamw_options = torch::optim::AdamWOptions(hyper.lr)
                           .betas({hyper.beta1, hyper.beta2})
                           .eps(hyper.eps)
                           .weight_decay(hyper.weight_decay);
  for (auto [dp, tp] : mesh_shapes()) {
    for (bool fused : {false, true}) {
      SCOPED_TRACE(fmt::format("mesh {}x{}, comm_fusion {}", dp, tp, fused));
      auto mesh = init_device_mesh("cpu", {dp, tp}, {"dp", "tp"});
      const int64_t dp_rank = mesh->coordinate(0);
      FullyShardOptions options;
      options.comm_fusion = fused;
      ReferenceAndModel models = reference_and_model(config, mesh, options);
      nn::GPT &reference = models.reference, &model = models.model;
      torch::optim::AdamW ref_opt(reference->parameters(), adamw_options);
      torch::optim::AdamW opt(model->parameters(), adamw_options);
      test::AdamWBound adam(hyper);

      auto gen = at::detail::createCPUGenerator(99);
      const int64_t b = 2, B = b * dp, T = config.context;
      const int64_t n_max = std::max({4 * config.n_embd, B * T, config.vocab_size}) + 1;
      for (int step = 0; step < 3; ++step) {
        SCOPED_TRACE("step " + std::to_string(step));
        at::Tensor idx = torch::randint(config.vocab_size, {B, T}, gen, torch::kLong);
        at::Tensor targets = torch::randint(config.vocab_size, {B, T}, gen, torch::kLong);
        test::load_into(model, reference);
        const nn::Sensitivity s = nn::measure_sensitivity(reference, config, idx, targets);
        auto bound = [&](const std::string& name) {
          return torch::scalar_tensor(
              test::reordered_sum_bound(s.per_unit.at(name), n_max, at::kDouble), torch::kDouble);
        };
        const nn::Named want = nn::forward_backward(reference, idx, targets);
        const nn::Named got = nn::forward_backward(model, idx.narrow(0, dp_rank * b, b),
                                                   targets.narrow(0, dp_rank * b, b));
        at::Tensor logits = is_dtensor(got.at("logits")) ? full_tensor(got.at("logits"))
                                                         : got.at("logits");
        EXPECT_TRUE(test::within_bound(logits, want.at("logits").narrow(0, dp_rank * b, b),
                                       bound("logits")));
        std::map<std::string, at::Tensor> before, grad_bound;
        for (const auto& p : model->named_parameters()) {
          const std::string g = "grad." + p.key();
          ASSERT_TRUE(p.value().grad().defined()) << g;
          if (is_dtensor(p.value())) {
            EXPECT_EQ(layout_of(p.value().grad()), layout_of(p.value())) << g;
          }
          grad_bound[p.key()] = bound(g);
          EXPECT_TRUE(test::within_bound(global_value(p.value(), p.value().grad()), want.at(g),
                                         grad_bound[p.key()]))
              << g;
          before[p.key()] = global_value(p.value(), p.value()).clone();
        }
        opt.step();
        ref_opt.step();
        auto ref_params = reference->named_parameters();
        for (const auto& p : model->named_parameters()) {
          at::Tensor bnd = adam.step(p.key(), before.at(p.key()), want.at("grad." + p.key()),
                                     grad_bound.at(p.key()));
          EXPECT_TRUE(test::within_bound(global_value(p.value(), p.value()),
                                         ref_params[p.key()], bnd))
              << p.key();
        }
        opt.zero_grad();
      }
    }
  }
}

// parallelize_value_and_grad over the 2-D model returns what .grad holds
// after backward(): each gradient the reduced shard, in its parameter's
// layout between steps (the 2-D layout of a DTensor parameter, the shard of
// a plain one), equal to one process's gradient within the bound of
// TrainsLikeOneProcess (the same computation: one step's gradients, with
// comm_fusion off and on); and every .grad is the tensor it was, with its
// values, here an earlier backward's gradients. A bare
// torch::autograd::grad over the parameters raises instead (on more than
// one rank).
TEST(GptFsdpTp, ValueAndGradReturnsReducedShards) {
  const nn::GPTConfig config = test::tp_small_config();
  for (auto [dp, tp] : mesh_shapes()) {
    for (bool fused : {false, true}) {
      SCOPED_TRACE(fmt::format("mesh {}x{}, comm_fusion {}", dp, tp, fused));
      auto mesh = init_device_mesh("cpu", {dp, tp}, {"dp", "tp"});
      const int64_t dp_rank = mesh->coordinate(0);
      FullyShardOptions options;
      options.comm_fusion = fused;
      ReferenceAndModel models = reference_and_model(config, mesh, options);
      nn::GPT &reference = models.reference, &model = models.model;

      auto gen = at::detail::createCPUGenerator(98);
      const int64_t b = 2, B = b * dp, T = config.context;
      const int64_t n_max = std::max({4 * config.n_embd, B * T, config.vocab_size}) + 1;
      auto batch = [&] {
        return std::pair{torch::randint(config.vocab_size, {B, T}, gen, torch::kLong),
                         torch::randint(config.vocab_size, {B, T}, gen, torch::kLong)};
      };
      auto mine = [&](const at::Tensor& t) { return t.narrow(0, dp_rank * b, b); };
      {
        auto [idx, targets] = batch();
        nn::forward_backward(model, mine(idx), mine(targets));
      }
      std::map<std::string, at::Tensor> held, held_values;
      for (const auto& p : model->named_parameters()) {
        ASSERT_TRUE(p.value().grad().defined()) << p.key();
        held[p.key()] = p.value().grad();
        held_values[p.key()] = global_value(p.value(), p.value().grad()).clone();
      }

      auto [idx, targets] = batch();
      const nn::Sensitivity s = nn::measure_sensitivity(reference, config, idx, targets);
      const nn::Named want = nn::forward_backward(reference, idx, targets);
      auto bound = [&](const std::string& name) {
        return torch::scalar_tensor(
            test::reordered_sum_bound(s.per_unit.at("grad." + name), n_max, at::kDouble),
            torch::kDouble);
      };

      // A bare torch::autograd::grad over the parameters would return
      // unreduced gradients of the unsharded parameters: refused, with the
      // units left usable for the call below. On one rank the units have
      // nothing to gather or reduce and hook no backward: it is right.
      at::Tensor bare_loss = nn::cross_entropy(model(mine(idx)), mine(targets));
      if (dist::get_world_size() == 1) {
        nn::TensorList bare = torch::autograd::grad({bare_loss}, model->parameters());
        auto params = model->named_parameters();
        for (size_t i = 0; i < bare.size(); ++i) {
          EXPECT_TRUE(test::within_bound(bare[i], want.at("grad." + params[i].key()),
                                         bound(params[i].key())))
              << params[i].key();
        }
      } else {
        EXPECT_THAT([&] { torch::autograd::grad({bare_loss}, model->parameters()); },
                    ThrowsMessage<ArgumentError>(HasSubstr(
                        "torch::autograd::grad was asked for the gradients of parameters")));
      }

      auto [loss, grads] = parallelize_value_and_grad(
          [&] { return nn::cross_entropy(model(mine(idx)), mine(targets)); },
          model->parameters())();

      auto params = model->named_parameters();
      ASSERT_EQ(grads.size(), params.size());
      for (size_t i = 0; i < grads.size(); ++i) {
        const std::string& name = params[i].key();
        const at::Tensor& param = params[i].value();
        SCOPED_TRACE(name);
        ASSERT_TRUE(grads[i].defined());
        EXPECT_EQ(is_dtensor(grads[i]), is_dtensor(param));
        if (is_dtensor(param)) {
          EXPECT_EQ(layout_of(grads[i]), layout_of(param)) << layout_of(grads[i]).str();
          EXPECT_EQ(local_of(grads[i]).sizes(), local_of(param).sizes());
        } else {
          EXPECT_EQ(grads[i].sizes(), param.sizes());
        }
        EXPECT_TRUE(test::within_bound(global_value(param, grads[i]), want.at("grad." + name),
                                       bound(name)));
        EXPECT_TRUE(param.grad().is_same(held.at(name)));
        EXPECT_TRUE(at::equal(global_value(param, param.grad()), held_values.at(name)));
      }
    }
  }
}

// clip_grad_norm_ reduces each gradient over exactly the mesh dims that
// split it: the norm is the reference's, never a piece counted once per
// replica or missed. Bound: each gradient element is within
// d_p = 4 n_max u S_p of the reference's (as above), so the squared norms
// differ by at most sum(2 |g| d_p + d_p^2), plus 4 N u sum(g^2) for the two
// sums of N squares in double in different orders; the norms then differ by
// at most that over the reference norm. The inf norm moves by at most max d_p.
TEST(GptFsdpTp, ClipGradNormCountsEachElementOnce) {
  const nn::GPTConfig config = test::tp_small_config();
  for (auto [dp, tp] : mesh_shapes()) {
    SCOPED_TRACE(fmt::format("mesh {}x{}", dp, tp));
    auto mesh = init_device_mesh("cpu", {dp, tp}, {"dp", "tp"});
    ReferenceAndModel models = reference_and_model(config, mesh);
    nn::GPT &reference = models.reference, &model = models.model;
    auto gen = at::detail::createCPUGenerator(5);
    const int64_t b = 2, B = b * dp, T = config.context;
    const int64_t n_max = std::max({4 * config.n_embd, B * T, config.vocab_size}) + 1;
    at::Tensor idx = torch::randint(config.vocab_size, {B, T}, gen, torch::kLong);
    at::Tensor targets = torch::randint(config.vocab_size, {B, T}, gen, torch::kLong);
    const int64_t rank = mesh->coordinate(0);
    const nn::Sensitivity s = nn::measure_sensitivity(reference, config, idx, targets);
    nn::forward_backward(reference, idx, targets);
    nn::forward_backward(model, idx.narrow(0, rank * b, b), targets.narrow(0, rank * b, b));
    const double u = test::unit_roundoff(at::kDouble);
    double sum_sq = 0, sq_bound = 0, want_inf = 0, inf_bound = 0;
    int64_t count = 0;
    for (const auto& p : reference->named_parameters()) {
      const at::Tensor& g = p.value().grad();
      const double d = test::reordered_sum_bound(s.per_unit.at("grad." + p.key()), n_max, at::kDouble);
      sum_sq += g.pow(2).sum().item<double>();
      sq_bound += (2 * g.abs() * d + d * d).sum().item<double>();
      want_inf = std::max(want_inf, g.abs().max().item<double>());
      inf_bound = std::max(inf_bound, d);
      count += g.numel();
    }
    sq_bound += 4.0 * count * u * sum_sq;
    const double want = std::sqrt(sum_sq);
    const double got = clip_grad_norm_(model->parameters(), /*max_norm=*/1e9).item<double>();
    EXPECT_TRUE(test::within_bound(got, want, sq_bound / want));
    const double inf = clip_grad_norm_(model->parameters(), 1e9, INFINITY).item<double>();
    EXPECT_TRUE(test::within_bound(inf, want_inf, inf_bound));
  }
}

// State dicts of the 2-D model: local DTensors with the 2-D layouts, whole
// tensors under GPT-2's names and shapes equal to the reference's, and a
// load of the whole tensors into a freshly parallelized model.
TEST(GptFsdpTp, StateDictsGiveGlobalTensorsByGpt2Name) {
  const nn::GPTConfig config = test::tp_small_config();
  for (auto [dp, tp] : mesh_shapes()) {
    SCOPED_TRACE(fmt::format("mesh {}x{}", dp, tp));
    auto mesh = init_device_mesh("cpu", {dp, tp}, {"dp", "tp"});
    nn::GPT reference = test::noisy_gpt(config, at::kDouble);
    nn::GPT model = test::noisy_gpt(config, at::kDouble);
    FSDPModule root = parallelize(model, mesh, {});
    StateDictOptions full;
    full.full_state_dict = true;
    StateDict whole = get_model_state_dict(*model, full);
    auto ref = reference->named_parameters();
    size_t checked = 0;
    for (const auto& [name, value] : whole) {
      if (!ref.contains(name)) continue;
      ASSERT_TRUE(std::holds_alternative<at::Tensor>(value)) << name;
      EXPECT_TRUE(at::equal(std::get<at::Tensor>(value), ref[name])) << name;
      ++checked;
    }
    EXPECT_EQ(checked, ref.size());

    nn::GPT other = test::noisy_gpt(config, at::kDouble);
    {
      torch::NoGradGuard no_grad;
      for (auto& p : other->parameters()) p.zero_();
    }
    FSDPModule other_root = parallelize(other, mesh, {});
    other_root.load_state_dict(whole);
    StateDict local = other_root.state_dict();
    for (const auto& [name, value] : local) {
      if (!ref.contains(name)) continue;
      ASSERT_TRUE(std::holds_alternative<DTensor>(value)) << name;
      EXPECT_TRUE(at::equal(std::get<DTensor>(value).full_tensor(), ref[name])) << name;
    }
  }
}

// The meshes must come from one init_device_mesh, and fully_shard may not
// take a dim tensor parallelism already shards.
TEST(GptFsdpTp, RefusesMeshesAndDimsThatDoNotCompose) {
  const int64_t n = dist::get_world_size();
  if (n < 2) GTEST_SKIP() << "needs a tensor-parallel dim";
  const nn::GPTConfig config = test::tp_small_config();
  auto mesh = init_device_mesh("cpu", {1, n}, {"dp", "tp"});
  auto other = init_device_mesh("cpu", {1, n}, {"dp2", "tp2"});
  nn::GPT model = test::noisy_gpt(config, at::kDouble);
  shard_module(model, (*mesh)["tp"], gpt_tensor_parallel_plan(config, *(*mesh)["tp"]));
  FullyShardOptions options;
  options.mesh = (*other)["dp2"];
  EXPECT_THAT([&] { fully_shard(model->blocks()[0].ptr(), options); },
              ThrowsMessage<ArgumentError>(HasSubstr("which is not a sub-mesh of the mesh")));
  options.mesh = (*mesh)["tp"];
  EXPECT_THAT([&] { fully_shard(model->blocks()[0].ptr(), options); },
              ThrowsMessage<ArgumentError>(HasSubstr("expected Replicate there")));
  options.mesh = (*mesh)["dp"];
  options.shard_placement_fn = [](const at::Tensor&) -> std::optional<Placement> {
    return Shard(0);
  };
  EXPECT_THAT([&] { fully_shard(model->blocks()[0].ptr(), options); },
              ThrowsMessage<ArgumentError>(HasSubstr("already shards dim 0")));
  options = FullyShardOptions{};
  EXPECT_THAT([&] { fully_shard(model->blocks()[0].ptr(), options); },
              ThrowsMessage<ArgumentError>(AllOf(HasSubstr("and options.mesh is not set"),
                                                 HasSubstr("Pass options.mesh = mesh[\"dp\"]"))));
}

}  // namespace
}  // namespace hp
