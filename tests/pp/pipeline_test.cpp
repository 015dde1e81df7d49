// The pipeline executor over pipeline ranks that are threads of this
// process (LoopbackTransport), against one process training the whole model
// on the same micro-batches.
#include "hp/pp/pipeline.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <exception>
#include <thread>
#include <utility>

#include "hp/nn/activation_checkpoint.h"
#include "hp/nn/gpt.h"
#include "hp/nn/llama.h"
#include "hp/nn/loss.h"
#include "hp/pp/lower.h"
#include "hp/util/error.h"
#include "tests/pp/pipeline_parity.h"
#include "tests/support/model_configs.h"
#include "tests/support/random_tokens.h"
#include "tests/support/tensor_checks.h"

namespace hp::pp {
namespace {

using testing::AllOf;
using testing::HasSubstr;
using testing::ThrowsMessage;

using parity::Case;

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

void expect_parity(const Case& c) {
  const parity::Run reference = parity::reference_run(c);
  // Built here, one rank after the other: the models draw their weights
  // from the one default generator.
  std::vector<std::vector<StageModule>> stages;
  for (int rank = 0; rank < c.ranks; ++rank) stages.push_back(parity::build_stages(c, rank));
  auto transports = LoopbackTransport::make(c.ranks);
  std::vector<parity::Run> runs(c.ranks);
  on_threads(c.ranks,
             [&](int rank) { runs[rank] = parity::pipeline_run(c, stages[rank], transports[rank]); });
  size_t compared = 0;
  for (int rank = 0; rank < c.ranks; ++rank)
    compared += parity::expect_rank_matches(c, rank, runs[rank], reference);
  EXPECT_EQ(compared, reference.params.size()) << parity::name_of(c);
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

// A timed step splits each rank's wall time into compute (F, B), waits on
// transfers and the rest; untimed, the figures stay zero.
TEST(Pipeline, StepStatsSplitEachRanksStepIntoComputeAndWaits) {
  const nn::GPTConfig config = test::small_gpt_config(4);
  nn::GPT whole(config);
  const StagePlan plan = plan_stages(gpt_layout(config), 2);
  auto transports = LoopbackTransport::make(2);
  auto loss = [](const at::Tensor& l, const at::Tensor& t) { return nn::cross_entropy(l, t); };
  const at::Tensor ids = test::random_tokens({4, 8}, config.vocab_size, 1);
  std::vector<StageModule> stages = {gpt_stage(*whole, plan, 0), gpt_stage(*whole, plan, 1)};
  std::vector<StepStats> untimed(2), timed(2);
  on_threads(2, [&](int rank) {
    Pipeline pipeline({{ScheduleKind::k1F1B, 2, 1, 4}, config.n_embd}, {stages[rank]},
                      transports[rank], loss);
    pipeline.step(ids, ids);
    untimed[rank] = pipeline.last_step_stats();
    pipeline.record_step_stats(true);
    pipeline.step(ids, ids);
    timed[rank] = pipeline.last_step_stats();
  });
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_EQ(untimed[rank].step_s, 0.0);
    EXPECT_EQ(untimed[rank].compute_s, 0.0);
    EXPECT_GT(timed[rank].compute_s, 0.0);
    EXPECT_GE(timed[rank].wait_s, 0.0);
    EXPECT_LE(timed[rank].compute_s + timed[rank].wait_s, timed[rank].step_s);
  }
}

// A small GPT cut into two stages, stage r for pipeline rank r.
struct TwoStages {
  nn::GPTConfig config = test::small_gpt_config(4);
  nn::GPT whole{config};
  StagePlan plan = plan_stages(gpt_layout(config), 2);
  std::vector<StageModule> stages = {gpt_stage(*whole, plan, 0), gpt_stage(*whole, plan, 1)};
};

// A transport that records each batch Pipeline posts, then posts it
// through a loopback transport.
class RecordingTransport : public Transport {
 public:
  explicit RecordingTransport(std::shared_ptr<Transport> inner) : inner_(std::move(inner)) {}
  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  std::unique_ptr<TransferHandle> send(const at::Tensor& t, int peer, int tag) override {
    return inner_->send(t, peer, tag);
  }
  std::unique_ptr<TransferHandle> recv(const at::Tensor& t, int peer, int tag) override {
    return inner_->recv(t, peer, tag);
  }
  std::vector<std::unique_ptr<TransferHandle>> post(const std::vector<Transfer>& batch) override {
    std::vector<std::string> kinds;
    for (const Transfer& t : batch)
      kinds.push_back(std::string(t.send ? "send" : "recv") +
                      (t.tag == kGradientTag ? "_b" : "_f"));
    batches.push_back(kinds);
    return inner_->post(batch);
  }
  std::vector<std::vector<std::string>> batches;

 private:
  std::shared_ptr<Transport> inner_;
};

// Each run of consecutive transfers in a rank's row is posted as one batch
// (one coalesced call on NCCL), in the row's order.
TEST(Pipeline, PostsEachRunOfTransfersAsOneBatch) {
  TwoStages two;
  const nn::GPTConfig& config = two.config;
  auto loopback = LoopbackTransport::make(2);
  std::vector<std::shared_ptr<RecordingTransport>> transports;
  for (int rank = 0; rank < 2; ++rank)
    transports.push_back(std::make_shared<RecordingTransport>(loopback[rank]));
  const at::Tensor ids = test::random_tokens({4, 8}, config.vocab_size, 1);
  std::vector<Rows> rows(2);
  on_threads(2, [&](int rank) {
    Pipeline pipeline({{ScheduleKind::k1F1B, 2, 1, 4}, config.n_embd}, {two.stages[rank]},
                      transports[rank], [](const at::Tensor& l, const at::Tensor& t) {
                        return nn::cross_entropy(l, t);
                      });
    pipeline.step(ids, ids);
    rows[rank] = pipeline.rows();
  });
  // Rank 0's row: 0F0,0SEND_F0,0F1,0SEND_F1,0RECV_B0,0B0,... (PpSendWaits).
  using V = std::vector<std::string>;
  EXPECT_THAT(transports[0]->batches,
              testing::ElementsAre(V{"send_f"}, V{"send_f", "recv_b"}, V{"send_f", "recv_b"},
                                   V{"send_f", "recv_b"}, V{"recv_b"}));
  // Every rank: one batch per run of transfers in its row.
  for (int rank = 0; rank < 2; ++rank) {
    std::vector<size_t> runs;
    size_t run = 0;
    for (const Action& a : rows[rank][rank]) {
      const bool transfer = a.op == Op::kSendF || a.op == Op::kRecvF || a.op == Op::kSendB ||
                            a.op == Op::kRecvB;
      if (transfer) ++run;
      if (!transfer && run > 0) runs.push_back(std::exchange(run, 0));
    }
    if (run > 0) runs.push_back(run);
    std::vector<size_t> posted;
    for (const auto& batch : transports[rank]->batches) posted.push_back(batch.size());
    EXPECT_EQ(posted, runs) << "rank " << rank;
  }
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
  TwoStages two;
  const nn::GPTConfig& config = two.config;
  // Rank 1's loss throws in its first forward: rank 0's first receive of a
  // gradient times out.
  auto transports = LoopbackTransport::make(2, std::chrono::milliseconds(200));
  const at::Tensor ids = test::random_tokens({2, 8}, config.vocab_size, 1);
  on_threads(2, [&](int rank) {
    Pipeline pipeline({{ScheduleKind::k1F1B, 2, 1, 2}, config.n_embd}, {two.stages[rank]},
                      transports[rank], [](const at::Tensor&, const at::Tensor&) -> at::Tensor {
                        throw std::runtime_error("the loss failed");
                      });
    if (rank == 0) {
      EXPECT_THAT([&] { pipeline.step(ids, ids); },
                  ThrowsMessage<CollectiveError>(HasSubstr("action 0B0 (#")));
    } else {
      EXPECT_THAT([&] { pipeline.step(ids, ids); },
                  ThrowsMessage<std::runtime_error>(
                      AllOf(HasSubstr("action 1F0 (#"), HasSubstr("the loss failed"))));
    }
    EXPECT_THAT([&] { pipeline.step(ids, ids); },
                ThrowsMessage<UnusableError>(HasSubstr("rebuild the pipeline")));
  });
}

// Neighbours whose boundaries differ (here rank 1's sequences are shorter)
// both stop at the step's start, naming both shapes, before any activation
// moves; the pipeline is unusable after.
TEST(Pipeline, NeighboursAgreeOnTheBoundaryShapeBeforeAnyActivationMoves) {
  TwoStages two;
  const nn::GPTConfig& config = two.config;
  auto transports = LoopbackTransport::make(2, std::chrono::milliseconds(2000));
  const std::string shape = "[2, 8, " + std::to_string(config.n_embd) + "] Float";
  const std::string shorter = "[2, 4, " + std::to_string(config.n_embd) + "] Float";
  std::vector<int> forwards(2, 0);
  on_threads(2, [&](int rank) {
    const at::Tensor ids = test::random_tokens({4, rank == 0 ? 8 : 4}, config.vocab_size, 1);
    Pipeline pipeline({{ScheduleKind::k1F1B, 2, 1, 2}, config.n_embd}, {two.stages[rank]},
                      transports[rank], [&](const at::Tensor& l, const at::Tensor& t) {
                        ++forwards[rank];
                        return nn::cross_entropy(l, t);
                      });
    const std::string mine = rank == 0 ? shape : shorter, theirs = rank == 0 ? shorter : shape;
    EXPECT_THAT([&] { pipeline.step(ids, ids); },
                ThrowsMessage<ArgumentError>(AllOf(
                    HasSubstr("pipeline rank " + std::to_string(rank)),
                    HasSubstr("hidden states are " + mine),
                    HasSubstr("pipeline rank " + std::to_string(1 - rank) + " (global rank " +
                              std::to_string(1 - rank) + "), expects " + theirs))));
    EXPECT_THAT([&] { pipeline.step(ids, ids); },
                ThrowsMessage<UnusableError>(HasSubstr("agree on its boundaries")));
  });
  EXPECT_EQ(forwards[1], 0) << "the last stage computed a loss";
}

}  // namespace
}  // namespace hp::pp
