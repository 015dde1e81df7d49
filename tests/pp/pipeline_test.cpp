// The pipeline executor over pipeline ranks that are threads of this
// process (LoopbackTransport), against one process training the whole model
// on the same micro-batches.
#include "hp/pp/pipeline.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <exception>
#include <thread>

#include "hp/nn/activation_checkpoint.h"
#include "hp/nn/gpt.h"
#include "hp/nn/llama.h"
#include "hp/nn/loss.h"
#include "hp/pp/lower.h"
#include "hp/util/error.h"
#include "tests/support/model_configs.h"
#include "tests/support/random_tokens.h"
#include "tests/support/tensor_checks.h"

namespace hp::pp {
namespace {

using testing::HasSubstr;
using testing::ThrowsMessage;

// Runs fn(rank) on `ranks` threads; rethrows the first failure.
template <typename Fn>
void on_threads(int ranks, Fn fn) {
  std::vector<std::exception_ptr> errors(ranks);
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r) {
    threads.emplace_back([&, r] {
      try {
        fn(r);
      } catch (...) {
        errors[r] = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
}

struct Case {
  ScheduleKind kind;
  int ranks;
  int stages_per_rank;
  int microbatches;
  std::vector<std::string> split_points;  // empty: balanced
  bool checkpointing = false;
  bool llama = false;
};

std::string name_of(const Case& c) {
  return hp::cat(to_string(c.kind), " p", c.ranks, " v", c.stages_per_rank, " m", c.microbatches,
                 c.split_points.empty() ? "" : " uneven", c.checkpointing ? " checkpointed" : "",
                 c.llama ? " llama" : "");
}

constexpr int kSteps = 2;
constexpr uint64_t kSeed = 21;

struct Model {
  std::shared_ptr<nn::Module> whole;
  int64_t vocab, width, layers;
};

Model build(const Case& c, int64_t layers) {
  torch::manual_seed(kSeed);
  if (c.llama) {
    nn::LlamaConfig config = test::tiny_llama_config();
    config.n_layer = layers;
    return {nn::Llama(config).ptr(), config.vocab_size, config.n_embd, layers};
  }
  const nn::GPTConfig config = test::small_gpt_config(layers);
  return {nn::GPT(config).ptr(), config.vocab_size, config.n_embd, layers};
}

StageModule stage_of(const Case& c, Model& model, const StagePlan& plan, int s) {
  if (c.llama) return llama_stage(static_cast<nn::LlamaImpl&>(*model.whole), plan, s);
  return gpt_stage(static_cast<nn::GPTImpl&>(*model.whole), plan, s);
}

ModelLayout layout_of(const Case& c, const Model& model) {
  if (c.llama) return llama_layout(static_cast<nn::LlamaImpl&>(*model.whole).config());
  return gpt_layout(static_cast<nn::GPTImpl&>(*model.whole).config());
}

at::Tensor batch(const Model& model, int step, int64_t rows, uint64_t salt) {
  return test::random_tokens({rows, 8}, model.vocab, 100 * step + salt);
}

// Losses, gradients and the parameters after AdamW steps are equal bit for
// bit: each stage runs the ops the whole model runs on the same values, the
// boundary gradient reaches a stage's output as it reaches the same tensor
// inside the whole model's graph (one sum of the same contributions), and
// every parameter's gradient accumulates over the micro-batches in
// micro-batch order in both.
void expect_parity(const Case& c) {
  SCOPED_TRACE(name_of(c));
  const ScheduleSpec spec{c.kind, c.ranks, c.stages_per_rank, c.microbatches};
  const int stages = num_stages(spec);
  const int64_t layers = std::max<int64_t>(stages + 1, 4);
  const int64_t rows = 2 * c.microbatches;

  // The reference: one process, the same micro-batches in order.
  Model reference = build(c, layers);
  torch::optim::AdamW ref_opt(reference.whole->parameters(), torch::optim::AdamWOptions(1e-2));
  std::vector<at::Tensor> ref_losses;
  std::map<std::string, at::Tensor> ref_grads;
  for (int step = 0; step < kSteps; ++step) {
    ref_opt.zero_grad();
    const auto ids = batch(reference, step, rows, 1).chunk(c.microbatches);
    const auto targets = batch(reference, step, rows, 2).chunk(c.microbatches);
    at::Tensor total;
    for (int k = 0; k < c.microbatches; ++k) {
      at::Tensor logits = c.llama ? static_cast<nn::LlamaImpl&>(*reference.whole).forward(ids[k])
                                  : static_cast<nn::GPTImpl&>(*reference.whole).forward(ids[k]);
      at::Tensor loss = nn::cross_entropy(logits, targets[k]) / c.microbatches;
      loss.backward();
      total = total.defined() ? total + loss.detach() : loss.detach();
    }
    ref_losses.push_back(total);
    if (step == kSteps - 1)
      for (const auto& item : reference.whole->named_parameters())
        ref_grads[item.key()] = item.value().grad().clone();
    ref_opt.step();
  }

  // Every rank's stages are built here, one rank after the other: the
  // models draw their weights from the one default generator.
  std::vector<std::vector<StageModule>> stages_of(c.ranks);
  for (int rank = 0; rank < c.ranks; ++rank) {
    Model model = build(c, layers);
    const StagePlan plan = plan_stages(layout_of(c, model), stages, c.split_points);
    for (int s : rank_stages(spec, rank)) {
      stages_of[rank].push_back(stage_of(c, model, plan, s));
      if (c.checkpointing)
        for (const auto& block : stages_of[rank].back()->blocks())
          nn::set_activation_checkpointing(*block);
    }
  }
  auto transports = LoopbackTransport::make(c.ranks);
  std::vector<std::map<std::string, at::Tensor>> params(c.ranks), grads(c.ranks);
  std::vector<std::vector<at::Tensor>> losses(c.ranks);
  on_threads(c.ranks, [&](int rank) {
    const std::vector<StageModule>& mine = stages_of[rank];
    Pipeline pipeline({spec, reference.width}, mine, transports[rank],
                      [](const at::Tensor& logits, const at::Tensor& targets) {
                        return nn::cross_entropy(logits, targets);
                      });
    torch::optim::AdamW opt(pipeline.parameters(), torch::optim::AdamWOptions(1e-2));
    for (int step = 0; step < kSteps; ++step) {
      opt.zero_grad();
      losses[rank].push_back(
          pipeline.step(batch(reference, step, rows, 1), batch(reference, step, rows, 2)));
      if (step == kSteps - 1)
        for (const auto& s : mine)
          for (const auto& item : s->named_parameters())
            grads[rank][item.key()] = item.value().grad().clone();
      opt.step();
    }
    for (const auto& s : mine)
      for (const auto& item : s->named_parameters()) params[rank][item.key()] = item.value();
  });

  const int last_rank = stage_rank(spec, stages - 1);
  for (int step = 0; step < kSteps; ++step) {
    for (int r = 0; r < c.ranks; ++r)
      EXPECT_EQ(losses[r][step].defined(), r == last_rank) << "rank " << r;
    EXPECT_TRUE(test::tensors_equal(losses[last_rank][step], ref_losses[step])) << "step " << step;
  }
  size_t count = 0;
  for (int r = 0; r < c.ranks; ++r) {
    for (const auto& [name, p] : params[r]) {
      EXPECT_TRUE(test::tensors_equal(grads[r].at(name), ref_grads.at(name))) << name;
      EXPECT_TRUE(test::tensors_equal(p, reference.whole->named_parameters()[name])) << name;
      ++count;
    }
  }
  EXPECT_EQ(count, reference.whole->parameters().size());
}

TEST(PipelineParity, GPipe) {
  for (int p : {2, 3, 4}) expect_parity({ScheduleKind::kGPipe, p, 1, p});
  expect_parity({ScheduleKind::kGPipe, 2, 1, 5, {"h.3"}});
}

TEST(PipelineParity, OneForwardOneBackward) {
  for (int p : {2, 3, 4}) {
    expect_parity({ScheduleKind::k1F1B, p, 1, p});
    expect_parity({ScheduleKind::k1F1B, p, 1, 2 * p});
  }
  expect_parity({ScheduleKind::k1F1B, 3, 1, 4, {"h.1", "h.2"}});
  expect_parity({ScheduleKind::k1F1B, 2, 1, 4, {}, /*checkpointing=*/true});
  expect_parity({ScheduleKind::k1F1B, 2, 1, 3, {}, false, /*llama=*/true});
}

TEST(PipelineParity, Interleaved) {
  for (int p : {2, 3, 4}) expect_parity({ScheduleKind::kInterleaved1F1B, p, 2, 2 * p});
  expect_parity({ScheduleKind::kInterleaved1F1B, 2, 2, 2});
}

TEST(PipelineParity, ZeroBubble) {
  // The rows run split backwards: I and W, no B.
  const Rows rows = lower({ScheduleKind::kZeroBubble, 2, 2, 4},
                          compute_rows({ScheduleKind::kZeroBubble, 2, 2, 4}));
  size_t inputs = 0, weights = 0, fulls = 0;
  for (const auto& row : rows)
    for (const Action& a : row) {
      inputs += a.op == Op::kBackwardInput;
      weights += a.op == Op::kBackwardWeight;
      fulls += a.op == Op::kBackward;
    }
  EXPECT_EQ(inputs, 16u);
  EXPECT_EQ(weights, 16u);
  EXPECT_EQ(fulls, 0u);
  for (int p : {2, 3, 4}) expect_parity({ScheduleKind::kZeroBubble, p, 2, 2 * p});
  expect_parity({ScheduleKind::kZeroBubble, 2, 2, 2});
  expect_parity({ScheduleKind::kZeroBubble, 2, 2, 4, {}, /*checkpointing=*/true});
}

TEST(Pipeline, RefusesBadInputBeforeAnyTransfer) {
  const nn::GPTConfig config = test::small_gpt_config(4);
  nn::GPT whole(config);
  const StagePlan plan = plan_stages(gpt_layout(config), 2);
  auto transports = LoopbackTransport::make(2);
  auto loss = [](const at::Tensor& l, const at::Tensor& t) { return nn::cross_entropy(l, t); };
  EXPECT_THAT(
      [&] {
        Pipeline({{ScheduleKind::k1F1B, 2, 1, 1}, config.n_embd}, {gpt_stage(*whole, plan, 0)},
                 transports[0], loss);
      },
      ThrowsMessage<ArgumentError>(HasSubstr("microbatches")));
  EXPECT_THAT(
      [&] {
        Pipeline({{ScheduleKind::k1F1B, 2, 1, 2}, config.n_embd}, {gpt_stage(*whole, plan, 1)},
                 transports[0], loss);
      },
      ThrowsMessage<ArgumentError>(
          HasSubstr("pipeline rank 0 runs stages [0] of the 1f1b schedule but was given [1]")));
  Pipeline pipeline({{ScheduleKind::k1F1B, 2, 1, 2}, config.n_embd}, {gpt_stage(*whole, plan, 0)},
                    transports[0], loss);
  const at::Tensor ids = test::random_tokens({3, 8}, config.vocab_size, 1);
  EXPECT_THAT([&] { pipeline.step(ids, ids); },
              ThrowsMessage<ArgumentError>(HasSubstr(
                  "batch size 3 must be a positive multiple of the schedule's 2 micro-batches")));
}

TEST(Pipeline, AFailedTransferNamesItsActionAndLeavesThePipelineUnusable) {
  const nn::GPTConfig config = test::small_gpt_config(4);
  nn::GPT whole(config);
  const StagePlan plan = plan_stages(gpt_layout(config), 2);
  // Rank 1 never runs: rank 0's first receive of a gradient times out.
  auto transports = LoopbackTransport::make(2, std::chrono::milliseconds(200));
  Pipeline pipeline(
      {{ScheduleKind::k1F1B, 2, 1, 2}, config.n_embd}, {gpt_stage(*whole, plan, 0)}, transports[0],
      [](const at::Tensor& l, const at::Tensor& t) { return nn::cross_entropy(l, t); });
  const at::Tensor ids = test::random_tokens({2, 8}, config.vocab_size, 1);
  EXPECT_THAT([&] { pipeline.step(ids, ids); },
              ThrowsMessage<CollectiveError>(HasSubstr("action 0B0 (#")));
  EXPECT_THAT([&] { pipeline.step(ids, ids); },
              ThrowsMessage<UnusableError>(HasSubstr("rebuild the pipeline")));
}

}  // namespace
}  // namespace hp::pp
