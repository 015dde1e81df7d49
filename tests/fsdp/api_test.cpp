// The fully_shard API around the training loop (F1, F9, F10, F13,
// F14, F15): state dicts in every mode, explicit unshard/reshard, the
// setters, replicate_params vs ignored_params, zero_grad, and every
// validation error with its message.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "hp/fsdp/clip_grad.h"
#include "hp/fsdp/storage.h"
#include "hp/tensor/shard_spec.h"
#include "hp/util/error.h"
#include "tests/fsdp/fsdp_test_util.h"
#include "tests/fsdp/gpt_fixture.h"
#include "tests/fsdp/toy_model.h"
#include "tests/support/tensor_checks.h"

namespace hp {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::Matcher;
using ::testing::StrEq;
using ::testing::ThrowsMessage;
using test::tensors_equal;


// One AdamW step of `model` on this rank's slice of batch 0.
void train_one_step(nn::GPT& model) {
  auto opt = test::make_adamw(*model);
  const int64_t rows = 12 / dist::get_world_size();
  test::gpt_loss(model, test::token_batch(0), dist::get_rank() * rows, rows).backward();
  opt.step();
}

TEST(FullyShardStateDict, RoundTripsInEveryModeAndValueKind) {
  for (const auto& mesh : test::mesh_configs()) {
    SCOPED_TRACE(mesh.name);
    FullyShardOptions options;
    options.mesh = test::make_mesh(mesh);
    auto source = test::make_gpt(/*seed=*/1);
    FSDPModule source_root = test::shard_gpt(source, options);
    train_one_step(source);
    auto expected = test::full_parameters(*source);

    // Local shards as DTensors.
    StateDict local = source_root.state_dict();
    for (const auto& [name, value] : local) {
      ASSERT_TRUE(std::holds_alternative<DTensor>(value)) << name;
      EXPECT_EQ(std::get<DTensor>(value).sizes(), expected.at(name).sizes().vec()) << name;
    }
    // Whole tensors, plain local tensors and DTensors all load.
    StateDict whole = get_model_state_dict(*source, {/*full_state_dict=*/true});
    StateDict plain_local;
    for (const auto& [name, value] : local) {
      plain_local.emplace_back(name, std::get<DTensor>(value).local().clone());
    }
    for (const StateDict* sd : {&local, &whole, &plain_local}) {
      auto target = test::make_gpt(/*seed=*/2);
      FSDPModule root = test::shard_gpt(target, options);
      root.load_state_dict(*sd);
      auto loaded = test::full_parameters(*target);
      for (const auto& [name, tensor] : expected) {
        EXPECT_TRUE(tensors_equal(loaded.at(name), tensor)) << name;
      }
    }
    // The whole tensors are the unsharded model's state: loaded by name into
    // a plain GPT, they cover every parameter with its shape, and the plain
    // model computes the sharded model's loss.
    auto plain = test::make_gpt(/*seed=*/3);
    auto plain_params = plain->named_parameters();
    ASSERT_EQ(whole.size(), plain_params.size());
    for (const auto& [name, value] : whole) {
      at::Tensor* target = plain_params.find(name);
      ASSERT_NE(target, nullptr) << name;
      const at::Tensor& tensor = std::get<at::Tensor>(value);
      ASSERT_EQ(tensor.sizes(), target->sizes()) << name;
      target->detach().copy_(tensor);
    }
    at::NoGradGuard no_grad;
    at::Tensor tokens = test::token_batch(5);
    // The same rows through the same kernels on the same values: equal.
    const double sharded_loss = test::gpt_loss(source, tokens, 0, 12).item<double>();
    EXPECT_EQ(test::gpt_loss(plain, tokens, 0, 12).item<double>(), sharded_loss);
  }
}

// cpu_offload copies a GPU model's values to the host; values already on
// the CPU are handed out as they are (no copy), sharded or whole.
TEST(FullyShardStateDict, CpuOffloadOfCpuValuesCopiesNothing) {
  auto model = test::make_gpt();
  FSDPModule root = test::shard_gpt(model, {});
  StateDictOptions offload;
  offload.cpu_offload = true;
  const StateDict plain = get_model_state_dict(*model);
  const StateDict offloaded = get_model_state_dict(*model, offload);
  ASSERT_EQ(offloaded.size(), plain.size());
  for (size_t i = 0; i < plain.size(); ++i) {
    ASSERT_EQ(offloaded[i].first, plain[i].first);
    auto local = [](const StateValue& v) {
      return std::holds_alternative<DTensor>(v) ? std::get<DTensor>(v).local()
                                                : std::get<at::Tensor>(v);
    };
    EXPECT_TRUE(local(offloaded[i].second).is_cpu()) << plain[i].first;
    // The same memory: nothing was copied.
    EXPECT_EQ(local(offloaded[i].second).data_ptr(), local(plain[i].second).data_ptr())
        << plain[i].first;
  }
}

TEST(FullyShardStateDict, Rank0OnlyAndStrictKeys) {
  auto model = test::make_gpt();
  FSDPModule root = test::shard_gpt(model, {});
  StateDict rank0 = get_model_state_dict(*model, {true, true, true});
  EXPECT_EQ(rank0.empty(), dist::get_rank() != 0);
  // rank0_only applies to whole tensors only: with local shards it is refused.
  EXPECT_THAT(
      [&] {
        get_model_state_dict(*model, {/*full_state_dict=*/false, false, /*rank0_only=*/true});
      },
      ThrowsMessage<ArgumentError>(
          StrEq("get_model_state_dict: rank0_only=true needs full_state_dict=true (only whole "
                "tensors can be kept on rank 0 alone), got full_state_dict=false")));

  // Values of another model (every one differs), less one key, plus one.
  const auto before = test::full_parameters(*model);
  auto other = test::make_gpt(/*seed=*/2);
  FSDPModule other_root = test::shard_gpt(other, {});
  const auto other_values = test::full_parameters(*other);
  StateDict sd = other_root.state_dict();
  sd.erase(std::remove_if(sd.begin(), sd.end(),
                          [](const auto& e) { return e.first == "h.0.ln_1.weight"; }),
           sd.end());
  sd.emplace_back("h.9.bogus", at::zeros({1}));
  EXPECT_THAT([&] { root.load_state_dict(sd); },
              ThrowsMessage<ArgumentError>(
                  StrEq("Error(s) in loading state_dict for GPT:\n\tMissing key(s): "
                        "'h.0.ln_1.weight'\n\tUnexpected key(s): 'h.9.bogus'")));
  // Not strict: the unexpected key is ignored, the rest loads, and the
  // missing parameter keeps its value.
  root.load_state_dict(sd, /*strict=*/false);
  auto loaded = test::full_parameters(*model);
  for (const auto& [name, value] : other_values) {
    const at::Tensor& expected = name == "h.0.ln_1.weight" ? before.at(name) : value;
    EXPECT_TRUE(tensors_equal(loaded.at(name), expected)) << name;
  }

  StateDict wrong = {{"wte.weight", at::zeros({3, 3})}};
  EXPECT_THAT(
      [&] { root.load_state_dict(wrong, /*strict=*/false); },
      ThrowsMessage<ArgumentError>(AllOf(
          HasSubstr("load 'wte.weight': plain tensor shape (3, 3) matches neither local shard ("),
          HasSubstr("nor global (50, 64)."))));
}

TEST(FullyShardStateDict, BadEntryAfterGoodOnesLoadsNothingOnAnyRank) {
  const int64_t world = dist::get_world_size(), rank = dist::get_rank();
  auto model = test::make_gpt(/*seed=*/1);
  FSDPModule root = test::shard_gpt(model, {});
  const auto before = test::full_parameters(*model);
  auto other = test::make_gpt(/*seed=*/2);  // every value differs from the model's
  StateDict good;
  for (auto& item : other->named_parameters()) good.emplace_back(item.key(), item.value().detach());
  auto expect_nothing_loaded = [&](const std::string& after) {
    SCOPED_TRACE(after);
    auto now = test::full_parameters(*model);
    for (const auto& [name, tensor] : before) {
      EXPECT_TRUE(tensors_equal(now.at(name), tensor)) << name;
    }
  };

  // The last entry has a shape no rank accepts.
  StateDict bad = good;
  bad.back().second = at::zeros({3, 3});
  EXPECT_THAT([&] { root.load_state_dict(bad); },
              ThrowsMessage<ArgumentError>(
                  HasSubstr("load '" + bad.back().first +
                            "': plain tensor shape (3, 3) matches neither local shard")));
  expect_nothing_loaded("a shape every rank rejects");

  // Rank 0's local shard shape of wte.weight, last: the last rank's shorter
  // shard rejects it, the others would accept it, and every rank raises.
  const int64_t first_chunk = chunk_span(50, world, 0).size;
  if (first_chunk != chunk_span(50, world, world - 1).size) {
    StateDict uneven;
    for (const auto& entry : good) {
      if (entry.first != "wte.weight") uneven.push_back(entry);
    }
    uneven.emplace_back("wte.weight", at::zeros({first_chunk, 64}));
    // Every rank raises (the check is collective); what it says depends on
    // whether this rank's own shard rejected the entry.
    const Matcher<std::string> says =
        rank == world - 1
            ? Matcher<std::string>(HasSubstr("load 'wte.weight': plain tensor shape (" +
                                             std::to_string(first_chunk) +
                                             ", 64) matches neither local shard"))
            : Matcher<std::string>(StrEq("load 'wte.weight': rejected on another rank (see its "
                                         "error); nothing was loaded"));
    EXPECT_THAT([&] { root.load_state_dict(uneven); }, ThrowsMessage<ArgumentError>(says));
    expect_nothing_loaded("a shape only some ranks reject");
  }

  // The good entries alone load.
  root.load_state_dict(good);
  auto loaded = test::full_parameters(*model);
  for (auto& item : other->named_parameters()) {
    EXPECT_TRUE(tensors_equal(loaded.at(item.key()), item.value())) << item.key();
  }
}

TEST(FullyShardApi, ExplicitUnshardAndReshard) {
  if (dist::get_world_size() < 2) GTEST_SKIP();
  auto model = test::make_gpt();
  test::shard_gpt(model, {});
  nn::Block block = model->blocks()[0];
  FSDPModule unit(block.ptr());
  const at::Tensor& w = block->mlp->c_fc->weight;
  EXPECT_LT(w.size(0), 256);
  unit.unshard();
  EXPECT_EQ(w.sizes().vec(), (std::vector<int64_t>{256, 64}));
  unit.reshard();
  EXPECT_LT(w.size(0), 256);
  UnshardHandle handle = unit.unshard(/*async_op=*/true);
  handle.wait();
  handle.wait();
  EXPECT_EQ(w.size(0), 256);
  // The gathered values are the model's: a forward after an explicit
  // unshard gives the same loss as without.
  unit.reshard();
  at::Tensor tokens = test::token_batch(0);
  const double before = test::gpt_loss(model, tokens, 0, 4).item<double>();
  unit.unshard(true);
  EXPECT_DOUBLE_EQ(test::gpt_loss(model, tokens, 0, 4).item<double>(), before);
}

TEST(FullyShardApi, ReshardAfterForwardSetterIsRecursive) {
  if (dist::get_world_size() < 2) GTEST_SKIP();
  auto model = test::make_gpt();
  FSDPModule root = test::shard_gpt(model, {});
  root.set_reshard_after_forward(false);
  at::Tensor loss = test::gpt_loss(model, test::token_batch(0), 0, 4);
  EXPECT_TRUE(fsdp::storage_is_allocated(model->blocks()[0]->mlp->c_fc->weight));
  loss.backward();
  root.set_reshard_after_forward(true);
  loss = test::gpt_loss(model, test::token_batch(0), 0, 4);
  EXPECT_FALSE(fsdp::storage_is_allocated(model->blocks()[0]->mlp->c_fc->weight));
  loss.backward();
  // Not recursive, on an inner unit: block 0 keeps its parameters gathered
  // after forward, block 1 still reshards.
  nn::Block b0 = model->blocks()[0], b1 = model->blocks()[1];
  FSDPModule(b0.ptr()).set_reshard_after_forward(false, /*recurse=*/false);
  loss = test::gpt_loss(model, test::token_batch(0), 0, 4);
  EXPECT_TRUE(fsdp::storage_is_allocated(b0->mlp->c_fc->weight));
  EXPECT_FALSE(fsdp::storage_is_allocated(b1->mlp->c_fc->weight));
  loss.backward();
  // The root keeps its parameters by default (its backward would gather
  // them right away), and frees them when asked to explicitly.
  root.set_reshard_after_forward(true);
  loss = test::gpt_loss(model, test::token_batch(0), 0, 4);
  EXPECT_EQ(model->wte->weight.size(0), 50);
  EXPECT_FALSE(fsdp::storage_is_allocated(model->wte->weight));
  loss.backward();
  root.set_reshard_after_forward(std::nullopt, /*recurse=*/false);
  EXPECT_FALSE(root.reshard_after_forward().has_value());
  loss = test::gpt_loss(model, test::token_batch(0), 0, 4);
  EXPECT_TRUE(fsdp::storage_is_allocated(model->wte->weight));
  EXPECT_FALSE(fsdp::storage_is_allocated(b1->mlp->c_fc->weight));
  loss.backward();
}

TEST(FullyShardApi, ReshardAfterForwardSetterOnASingleUnitRoot) {
  // A root without inner units reshards after forward like any unit, so
  // the non-recursive setter's effect on the root itself shows.
  if (dist::get_world_size() < 2) GTEST_SKIP();
  const int64_t world = dist::get_world_size(), rank = dist::get_rank();
  auto model = test::make_toy_model();
  FSDPModule root = fully_shard(model.ptr());
  auto [x, y] = test::global_batch(0);
  const at::Tensor& w = model->embed->weight;
  for (bool reshard : {true, false, true}) {
    SCOPED_TRACE(reshard ? "reshard" : "keep");
    root.set_reshard_after_forward(reshard, /*recurse=*/false);
    at::Tensor loss =
        torch::mse_loss(model(test::rows_for(x, rank, world)), test::rows_for(y, rank, world));
    EXPECT_EQ(w.size(0), 10);
    EXPECT_EQ(fsdp::storage_is_allocated(w), !reshard);
    loss.backward();
    EXPECT_EQ(w.size(0), chunk_span(10, world, rank).size);
  }
}

TEST(FullyShardApi, ZeroGradDropsGradients) {
  auto model = test::make_gpt();
  FSDPModule root = test::shard_gpt(model, {});
  test::gpt_loss(model, test::token_batch(0), 0, 4).backward();
  for (auto& p : model->parameters()) EXPECT_TRUE(p.grad().defined());
  root.zero_grad();
  for (auto& p : model->parameters()) EXPECT_FALSE(p.grad().defined());
}

TEST(FullyShardApi, ReplicateParamsAreAllReducedIgnoredParamsAreLocal) {
  const int64_t world = dist::get_world_size(), rank = dist::get_rank();
  auto reference = test::make_toy_model();
  auto model = test::make_toy_model();
  FullyShardOptions options;
  options.replicate_params = {model->head->weight};
  options.ignored_params = {model->embed->bias};
  fully_shard(model.ptr(), options);
  // Replicated: whole; ignored: whole and untouched; others sharded.
  EXPECT_EQ(model->head->weight.sizes().vec(), (std::vector<int64_t>{5, 10}));
  EXPECT_EQ(model->embed->bias.sizes().vec(), (std::vector<int64_t>{10}));
  EXPECT_EQ(model->embed->weight.size(0), chunk_span(10, world, rank).size);

  auto [x, y] = test::global_batch(0);
  test::data_parallel_backward(reference->parameters(), reference->parameters(), world,
                               [&](int64_t part) {
                                 return torch::mse_loss(reference(test::rows_for(x, part, world)),
                                                        test::rows_for(y, part, world));
                               });
  torch::mse_loss(model(test::rows_for(x, rank, world)), test::rows_for(y, rank, world)).backward();
  // The replicated parameter's gradient is the global one on every rank,
  // within the reordering bound of the ranks' terms.
  EXPECT_TRUE(test::within_bound(model->head->weight.grad(), reference->head->weight.grad(),
                                 test::gradient_bounds(reference).at("head.weight")));
  // The ignored one only saw this rank's rows.
  auto local_ref = test::make_toy_model();
  torch::mse_loss(local_ref(test::rows_for(x, rank, world)), test::rows_for(y, rank, world))
      .backward();
  // The same rows through the same kernels: equal.
  EXPECT_TRUE(tensors_equal(model->embed->bias.grad(), local_ref->embed->bias.grad()));
}

TEST(FullyShardApi, OneRankMeshAccumulatesLikeThePlainModel) {
  // Each rank alone on the "solo" dim of a [world, 1] mesh: nothing to
  // communicate, so fully_shard takes its hook fast path. Two backwards
  // without zero_grad, then an AdamW step, must match the plain model
  // exactly (same kernels, same order).
  auto mesh = init_device_mesh("cpu", {dist::get_world_size(), 1}, {"rest", "solo"});
  auto reference = test::make_toy_model();
  auto model = test::make_toy_model();
  FullyShardOptions options;
  options.mesh = (*mesh)["solo"];
  for (auto& block : model->block_list) fully_shard(block.ptr(), options);
  FSDPModule root = fully_shard(model.ptr(), options);
  auto ref_opt = torch::optim::AdamW(reference->parameters(), torch::optim::AdamWOptions(1e-2));
  auto opt = torch::optim::AdamW(model->parameters(), torch::optim::AdamWOptions(1e-2));
  for (int64_t step = 0; step < 2; ++step) {
    auto [x, y] = test::global_batch(step);
    torch::mse_loss(reference(x), y).backward();
    torch::mse_loss(model(x), y).backward();
  }
  auto ref_params = reference->named_parameters();
  for (auto& item : model->named_parameters()) {
    EXPECT_TRUE(tensors_equal(item.value().grad(), ref_params[item.key()].grad())) << item.key();
  }
  ref_opt.step();
  opt.step();
  for (auto& item : model->named_parameters()) {
    EXPECT_TRUE(tensors_equal(item.value(), ref_params[item.key()])) << item.key();
  }
}

TEST(FullyShardErrors, ArgumentErrorsNameTheProblem) {
  const int world = dist::get_world_size();
  EXPECT_THAT([] { fully_shard(std::shared_ptr<nn::Module>()); },
              ThrowsMessage<ArgumentError>(StrEq("fully_shard: module must not be null")));
  EXPECT_THAT(
      [] { fully_shard(std::vector<std::shared_ptr<nn::Module>>{}); },
      ThrowsMessage<ArgumentError>(StrEq("fully_shard does not support empty list of modules.")));
  auto model = test::make_gpt();
  EXPECT_THAT([&] { fully_shard(std::vector<std::shared_ptr<nn::Module>>{model.ptr(), nullptr}); },
              ThrowsMessage<ArgumentError>(HasSubstr("a null module at index 1")));

  // Outer unit first, then an inner one.
  auto outer_first = test::make_gpt();
  fully_shard(outer_first.ptr());
  EXPECT_THAT(
      [&] {
        nn::Block b = outer_first->blocks()[0];
        fully_shard(b.ptr());
      },
      ThrowsMessage<ArgumentError>(
          HasSubstr("is already managed by the unit of GPT, which contains this module; apply "
                    "fully_shard to submodules before their parents")));
  EXPECT_THAT(
      [&] { fully_shard(outer_first.ptr()); },
      ThrowsMessage<ArgumentError>(HasSubstr("module GPT is already managed by fully_shard")));

  FullyShardOptions options;
  options.mesh = init_device_mesh("cpu", {1, 1, world}, {"a", "b", "c"});
  EXPECT_THAT([&] { fully_shard(test::make_gpt().ptr(), options); },
              ThrowsMessage<ArgumentError>(
                  HasSubstr("fully_shard expects a 1-D mesh (FSDP) or a 2-D (replicate, shard) "
                            "mesh (HSDP), got a 3-D mesh ['a', 'b', 'c']")));

  options = {};
  options.shard_placement_fn = [](const at::Tensor&) { return std::optional<Placement>(Replicate()); };
  EXPECT_THAT([&] { fully_shard(test::make_gpt().ptr(), options); },
              ThrowsMessage<ArgumentError>(
                  HasSubstr("shard_placement_fn must return Shard(dim) or nullopt, but returned R "
                            "for parameter 'wte.weight'")));
  options.shard_placement_fn = [](const at::Tensor&) { return std::optional<Placement>(Shard(2)); };
  EXPECT_THAT(
      [&] { fully_shard(test::make_gpt().ptr(), options); },
      ThrowsMessage<ArgumentError>(HasSubstr(
          "returned S(2) for parameter 'wte.weight' of shape [50, 64], out of range for 2 dims")));
  if (world == 3) {
    options.shard_placement_fn = [](const at::Tensor& p) {
      return p.dim() == 2 ? std::optional<Placement>(Shard(1)) : std::nullopt;
    };
    EXPECT_THAT([&] { fully_shard(test::make_gpt().ptr(), options); },
                ThrowsMessage<ArgumentError>(HasSubstr(
                    "parameter 'wte.weight' of shape [50, 64] cannot be sharded on dim 1 over 3 "
                    "ranks: 64 is not divisible by 3 (only dim 0 is padded when uneven)")));
  }

  auto toy = test::make_toy_model();
  options = {};
  options.ignored_params = {at::zeros({3})};
  EXPECT_THAT(
      [&] { fully_shard(toy.ptr(), options); },
      ThrowsMessage<ArgumentError>(HasSubstr("ignored_params contains a tensor of shape [3] that "
                                             "is not a parameter of the module(s) being sharded")));
  options = {};
  options.ignored_params = {toy->head->weight};
  options.replicate_params = {toy->head->weight};
  EXPECT_THAT([&] { fully_shard(toy.ptr(), options); },
              ThrowsMessage<ArgumentError>(HasSubstr(
                  "parameter 'head.weight' is in both ignored_params and replicate_params")));

  auto sharded = test::make_gpt();
  FSDPModule root = test::shard_gpt(sharded, {});
  EXPECT_THAT([&] { root.set_reduce_op_type("max"); },
              ThrowsMessage<ArgumentError>(
                  StrEq("Unsupported reduce op type max, supported types are ['sum', 'avg']")));
  EXPECT_THAT([&] { FSDPModule plain(test::make_gpt().ptr()); },
              ThrowsMessage<ArgumentError>(HasSubstr(
                  "module GPT is not managed by fully_shard; call hp::fully_shard(module) first")));
  EXPECT_THAT([&] { clip_grad_norm_(sharded->parameters(), 1.0, 3.0); },
              ThrowsMessage<ArgumentError>(HasSubstr("norm_type must be 2.0 or inf, got 3")));
}

TEST(FullyShardErrors, LateValidationErrorLeavesTheModelUntouched) {
  // Errors found only after other parameters were looked at must leave
  // every parameter whole and unmanaged, so a retry with fixed options works.
  const int64_t world = dist::get_world_size(), rank = dist::get_rank();
  auto reference = test::make_toy_model();
  auto model = test::make_toy_model();
  auto expect_untouched = [&](const std::string& after) {
    SCOPED_TRACE(after);
    EXPECT_FALSE(is_fully_sharded(*model));
    auto ref = reference->named_parameters();
    for (auto& item : model->named_parameters()) {
      EXPECT_TRUE(tensors_equal(item.value(), ref[item.key()])) << item.key();
    }
  };
  // head.weight is the last parameter: every other one passed its checks.
  FullyShardOptions options;
  options.comm_fusion = true;
  options.replicate_params = {model->head->weight};
  options.ignored_params = {model->head->weight};
  EXPECT_THAT([&] { fully_shard(model.ptr(), options); },
              ThrowsMessage<ArgumentError>(HasSubstr(
                  "parameter 'head.weight' is in both ignored_params and replicate_params")));
  expect_untouched("a parameter both replicated and ignored");

  // A dtype that differs, seen last.
  model->head->weight.set_data(model->head->weight.detach().to(at::kDouble));
  // The message names the mode the mesh selects.
  EXPECT_THAT([&] { fully_shard(model.ptr(), FullyShardOptions{}); },
              ThrowsMessage<ArgumentError>(
                  HasSubstr("FSDP expects uniform original parameter dtype but got")));
  options = {};
  options.mesh = init_device_mesh("cpu", {world, 1}, {"replicate", "shard"});
  EXPECT_THAT([&] { fully_shard(model.ptr(), options); },
              ThrowsMessage<ArgumentError>(
                  HasSubstr("DDP expects uniform original parameter dtype but got")));
  if (world == 4) {
    options.mesh = init_device_mesh("cpu", {2, 2}, {"replicate", "shard"});
    EXPECT_THAT([&] { fully_shard(model.ptr(), options); },
                ThrowsMessage<ArgumentError>(
                    HasSubstr("HSDP expects uniform original parameter dtype but got")));
  }
  model->head->weight.set_data(model->head->weight.detach().to(at::kFloat));
  expect_untouched("non-uniform dtype");

  if (world > 1) {
    options = {};
    options.reshard_after_forward = int64_t{world + 1};
    EXPECT_THAT([&] { fully_shard(model.ptr(), options); },
                ThrowsMessage<ArgumentError>(HasSubstr(
                    "must be a divisor of the shard group size " + std::to_string(world))));
    expect_untouched("reshard_after_forward not a divisor");
  }

  // Fixed options: the model shards and trains like the reference.
  options = {};
  options.comm_fusion = true;
  for (auto& block : model->block_list) fully_shard(block.ptr(), options);
  fully_shard(model.ptr(), options);
  EXPECT_TRUE(is_fully_sharded(*model));
  auto [x, y] = test::global_batch(0);
  test::data_parallel_backward(reference->parameters(), reference->parameters(), world,
                               [&](int64_t part) {
                                 return torch::mse_loss(reference(test::rows_for(x, part, world)),
                                                        test::rows_for(y, part, world));
                               });
  torch::mse_loss(model(test::rows_for(x, rank, world)), test::rows_for(y, rank, world)).backward();
  test::expect_gradients_match(model, reference);
}

// A module with a parameter left on the meta device.
struct MetaImpl : nn::Module {
  MetaImpl() : nn::Module("Meta") {
    w = register_parameter("w", torch::empty({4, 2}, torch::TensorOptions().device(at::kMeta)));
  }
  at::Tensor forward(const at::Tensor& x) { return x; }
  at::Tensor w;
};
HP_MODULE(Meta);

TEST(FullyShardErrors, LazyInitRefusesMetaParameters) {
  Meta meta;
  fully_shard(meta.ptr());
  EXPECT_THAT([&] { meta(torch::ones({1})); },
              ThrowsMessage<ArgumentError>(StrEq(
                  "FSDP parameters should be materialized from meta device before training, but "
                  "the following were still on meta device: ['w']\nFor example, initialize the "
                  "module weights on a real device before running training.\nThey are "
                  "uninitialised: after fully_shard over a meta model, call "
                  "hp::init_sharded(model, plan) (e.g. plan = model->init_plan(); "
                  "hp/fsdp/materialize.h) or hp::checkpoint::load_into_shards(model, path) "
                  "(hp/checkpoint/load_into_shards.h) before the first forward.")));
}

}  // namespace
}  // namespace hp

namespace hp {
namespace {

// Gradients of the sharded model against the reference, shard by shard,
// within the reordering bound of the terms reference_backward recorded.
void expect_grads_match_reference(nn::GPT& model, nn::GPT& reference) {
  test::expect_gradients_match(model, reference);
}

// set_requires_all_reduce(false) on meshes with replicas: nothing is
// all-reduced (HSDP's shards are only reduce-scattered; with comm_fusion
// the whole parameters' all-reduce, which would reach the replicas, is not
// issued), no gradient is assigned yet, and the backward with all-reduce
// reduces both micro-batches' gradients.
TEST(FullyShardSetters, RequiresAllReduceFalseAccumulatesUntilTheLastMicroBatch) {
  for (const auto& mesh : test::mesh_configs()) {
    if (mesh.name == "fsdp") continue;  // no replicas: nothing to skip
    for (const auto& reduction : test::gpt_reductions()) {
      SCOPED_TRACE(mesh.name + ", " + reduction.name);
      auto reference = test::make_gpt();
      auto model = test::make_gpt();
      FullyShardOptions options;
      options.mesh = test::make_mesh(mesh);
      options.comm_fusion = reduction.comm_fusion;
      FSDPModule root = test::shard_gpt(model, options, reduction.replicated);
      for (int micro = 0; micro < 2; ++micro) {
        at::Tensor tokens = test::token_batch(micro);
        test::reference_backward(reference, tokens, dist::get_world_size());
        root.set_requires_all_reduce(micro == 1);
        dist::reset_comm_stats();
        test::gpt_loss(model, tokens, test::my_first_row(), test::my_rows()).backward();
        if (micro == 0 && dist::get_world_size() > 1) {  // one rank: no replicas
          EXPECT_EQ(dist::comm_stats()[dist::OpType::kAllReduce], 0);
          EXPECT_FALSE(model->ln_f->weight.grad().defined());
        }
      }
      expect_grads_match_reference(model, reference);
    }
  }
}

TEST(FullyShardSetters, IsLastBackwardFalseLandsAtTheNextForward) {
  auto reference = test::make_gpt();
  auto model = test::make_gpt();
  FSDPModule root = test::shard_gpt(model, {});
  // First micro-batch: its reductions may still be in flight afterwards.
  root.set_is_last_backward(false);
  test::reference_backward(reference, test::token_batch(0), dist::get_world_size());
  test::gpt_loss(model, test::token_batch(0), test::my_first_row(), test::my_rows()).backward();
  // The next forward lands them; its backward adds to them.
  root.set_is_last_backward(true);
  test::reference_backward(reference, test::token_batch(1), dist::get_world_size());
  test::gpt_loss(model, test::token_batch(1), test::my_first_row(), test::my_rows()).backward();
  expect_grads_match_reference(model, reference);
}

TEST(FullyShardSetters, IsLastBackwardSetThroughAnInnerUnitAppliesToTheRoot) {
  if (dist::get_world_size() < 2) GTEST_SKIP();
  auto reference = test::make_gpt();
  auto model = test::make_gpt();
  test::shard_gpt(model, {});
  nn::Block block = model->blocks()[0];
  FSDPModule inner(block.ptr());
  for (int micro = 0; micro < 3; ++micro) {
    // Micro-batch 0 runs before the root exists (lazy init), 1 after.
    const bool last = micro == 2;
    inner.set_is_last_backward(last);
    at::Tensor tokens = test::token_batch(micro);
    test::reference_backward(reference, tokens, dist::get_world_size());
    test::gpt_loss(model, tokens, test::my_first_row(), test::my_rows()).backward();
    // Not the last: the root's own reductions (issued last) are still in
    // flight, so its parameters have no gradient yet.
    EXPECT_EQ(model->wte->weight.grad().defined(), last) << "micro-batch " << micro;
  }
  expect_grads_match_reference(model, reference);
}

TEST(FullyShardSetters, ReshardAfterBackwardFalseKeepsCopiesAcrossNoSyncMicroBatches) {
  if (dist::get_world_size() < 2) GTEST_SKIP();
  auto reference = test::make_gpt();
  auto model = test::make_gpt();
  FSDPModule root = test::shard_gpt(model, {});
  const at::Tensor& w = model->blocks()[0]->mlp->c_fc->weight;
  const int64_t shard_rows = chunk_span(256, dist::get_world_size(), dist::get_rank()).size;
  for (int micro = 0; micro < 3; ++micro) {
    const bool last = micro == 2;
    root.set_requires_gradient_sync(last);
    root.set_reshard_after_backward(last);
    at::Tensor tokens = test::token_batch(micro);
    test::reference_backward(reference, tokens, dist::get_world_size());
    const int64_t gathers = dist::comm_stats()[dist::OpType::kAllGather];
    at::Tensor loss = test::gpt_loss(model, tokens, test::my_first_row(), test::my_rows());
    // The copies kept by the previous micro-batch's backward serve this
    // forward: it gathers nothing.
    if (micro > 0) {
      EXPECT_EQ(dist::comm_stats()[dist::OpType::kAllGather], gathers) << "micro-batch " << micro;
    }
    loss.backward();
    // Between micro-batches the parameter holds its shard, the copy aside.
    EXPECT_EQ(w.size(0), shard_rows) << "micro-batch " << micro;
  }
  expect_grads_match_reference(model, reference);
}

}  // namespace
}  // namespace hp

namespace hp {
namespace {

TEST(FullyShardErrors, MeshWithoutThisRankAndDTensorShapes) {
  if (dist::get_world_size() < 2) GTEST_SKIP();
  // A mesh of rank 0 alone: the other ranks are refused before anything else.
  auto solo = DeviceMesh::create("cpu", {1}, {0}, {"solo"});
  if (dist::get_rank() != 0) {
    FullyShardOptions options;
    options.mesh = solo;
    EXPECT_THAT([&] { fully_shard(test::make_gpt().ptr(), options); },
                ThrowsMessage<ArgumentError>(
                    HasSubstr("fully_shard: rank " + std::to_string(dist::get_rank()) +
                              " is not part of DeviceMesh('cpu', shape [1], ranks [0]")));
  }
  // A DTensor value whose global shape differs from the parameter's.
  auto model = test::make_gpt();
  FSDPModule root = test::shard_gpt(model, {});
  auto mesh = init_device_mesh("cpu", {dist::get_world_size()}, {"shard"});
  StateDict wrong = {{"wpe.weight", distribute_tensor(at::zeros({8, 64}), mesh, {Shard(0)})}};
  EXPECT_THAT([&] { root.load_state_dict(wrong, /*strict=*/false); },
              ThrowsMessage<ArgumentError>(
                  HasSubstr("load 'wpe.weight': DTensor of global shape [8, 64] does not match the "
                            "parameter's global shape [16, 64]")));
}

}  // namespace
}  // namespace hp
