// hp/pp: the actions' text, the schedules' specs and rows, validate(),
// lower() and simulate(). The rows' agreement with PyTorch's own schedules
// is tests/pp/schedule_oracle.py's.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <map>
#include <tuple>

#include "hp/pp/action.h"
#include "hp/pp/lower.h"
#include "hp/pp/schedule.h"
#include "hp/pp/send_waits.h"
#include "hp/pp/simulate.h"
#include "hp/util/error.h"

namespace hp::pp {
namespace {

using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::ThrowsMessage;

constexpr ScheduleKind kAllKinds[] = {ScheduleKind::kGPipe, ScheduleKind::k1F1B,
                                      ScheduleKind::kInterleaved1F1B, ScheduleKind::kZeroBubble};

bool looped(ScheduleKind kind) {
  return kind == ScheduleKind::kInterleaved1F1B || kind == ScheduleKind::kZeroBubble;
}

// Every spec of the grid: p in {1, 2, 3, 4, 8}, m in {p, p+1, 2p, 3p} where
// the schedule accepts it, v in {1, 2} for the looped schedules.
std::vector<ScheduleSpec> grid() {
  std::vector<ScheduleSpec> specs;
  for (ScheduleKind kind : kAllKinds) {
    for (int p : {1, 2, 3, 4, 8}) {
      for (int m : {p, p + 1, 2 * p, 3 * p}) {
        for (int v : {1, 2}) {
          if (v == 2 && !looped(kind)) continue;
          ScheduleSpec spec{kind, p, v, m};
          try {
            check_spec(spec);
          } catch (const ArgumentError&) {
            continue;  // p + 1 micro-batches where rounds do not divide them
          }
          specs.push_back(spec);
        }
      }
    }
  }
  return specs;
}

std::string name(const ScheduleSpec& spec) {
  return std::string(to_string(spec.kind)) + " p=" + std::to_string(spec.ranks) +
         " v=" + std::to_string(spec.stages_per_rank) + " m=" + std::to_string(spec.microbatches);
}

// ---- actions -------------------------------------------------------------

TEST(PpAction, SpellsActionsAsPyTorch) {
  EXPECT_EQ(to_string(Action{2, Op::kForward, 0}), "2F0");
  EXPECT_EQ(to_string(Action{1, Op::kBackward, 3}), "1B3");
  EXPECT_EQ(to_string(Action{0, Op::kBackwardInput, 1}), "0I1");
  EXPECT_EQ(to_string(Action{0, Op::kBackwardWeight, 1}), "0W1");
  EXPECT_EQ(to_string(Action{1, Op::kSendF, 3}), "1SEND_F3");
  EXPECT_EQ(to_string(Action{1, Op::kRecvB, 0}), "1RECV_B0");
  EXPECT_EQ(to_string(Action{0, Op::kUnshard, -1}), "0UNSHARD");
  EXPECT_EQ(to_string(Action{0, Op::kReduceGrad, -1}), "0REDUCE_GRAD");
  EXPECT_EQ(to_string(Action{12, Op::kReshard, -1}), "12RESHARD");
}

TEST(PpAction, ParsesEveryOpBack) {
  for (Op op : {Op::kForward, Op::kBackward, Op::kBackwardInput, Op::kBackwardWeight, Op::kSendF,
                Op::kRecvF, Op::kSendB, Op::kRecvB, Op::kUnshard, Op::kReshard, Op::kReduceGrad}) {
    Action a{17, op, is_stage_wide(op) ? -1 : 123};
    EXPECT_EQ(parse_action(to_string(a)), a) << to_string(a);
  }
  EXPECT_EQ(parse_action("  3SEND_B10 "), (Action{3, Op::kSendB, 10}));
}

TEST(PpAction, RefusesMalformedTextNamingIt) {
  auto refused = [](const char* text) {
    EXPECT_THAT([&] { parse_action(text); },
                ThrowsMessage<ArgumentError>(HasSubstr(std::string("'") + text + "'")))
        << text;
  };
  for (const char* text : {"", "F0", "2X0", "2F", "2F0x", "0UNSHARD3", "1WAIT_SEND_F0", "1F-1",
                           "99999999999F0", "(0F0;1B0)OVERLAP_F_B"}) {
    refused(text);
  }
  EXPECT_THAT([] { parse_action("0RESHARD1"); },
              ThrowsMessage<ArgumentError>(HasSubstr("takes no micro-batch")));
}

TEST(PpAction, CsvRoundTripsAndReadsPyTorchsDump) {
  Rows rows = {
      {{0, Op::kForward, 0}, {0, Op::kSendF, 0}, {0, Op::kUnshard, -1}}, {}, {{2, Op::kRecvF, 0}}};
  EXPECT_EQ(to_csv(rows), "0F0,0SEND_F0,0UNSHARD\n\n2RECV_F0\n");
  EXPECT_EQ(parse_csv(to_csv(rows)), rows);
  // csv.writer: "\r\n" endings, idle steps (None) as empty cells.
  EXPECT_EQ(parse_csv("0F0,,0B0\r\n1F0, 1B0\r\n"),
            (Rows{{{0, Op::kForward, 0}, {0, Op::kBackward, 0}},
                  {{1, Op::kForward, 0}, {1, Op::kBackward, 0}}}));
  EXPECT_THAT([] { parse_csv("0F0\n1F0,1Q0\n"); },
              ThrowsMessage<ArgumentError>(
                  AllOf(HasSubstr("line 2 (rank 1), cell 2"), HasSubstr("'1Q0'"))));
}

// ---- specs and placement -------------------------------------------------

TEST(PpSpec, NamesKinds) {
  for (ScheduleKind kind : kAllKinds) EXPECT_EQ(parse_schedule_kind(to_string(kind)), kind);
  EXPECT_STREQ(to_string(ScheduleKind::kZeroBubble), "zero-bubble");
  EXPECT_THAT([] { parse_schedule_kind("zb1p"); },
              ThrowsMessage<ArgumentError>(
                  AllOf(HasSubstr("'zb1p'"), HasSubstr("gpipe, 1f1b, interleaved"))));
}

TEST(PpSpec, RefusesFewerMicrobatchesThanRanksNamingBoth) {
  for (ScheduleKind kind : kAllKinds) {
    EXPECT_THAT(
        [&] {
          check_spec({kind, 4, 1, 3});
        },
        ThrowsMessage<ArgumentError>(AllOf(HasSubstr("microbatches = 3"), HasSubstr("ranks = 4"))))
        << to_string(kind);
  }
}

TEST(PpSpec, RefusesBadArgumentsNamingThem) {
  EXPECT_THAT(
      [] {
        check_spec({ScheduleKind::k1F1B, 0, 1, 4});
      },
      ThrowsMessage<ArgumentError>(HasSubstr("ranks = 0")));
  EXPECT_THAT(
      [] {
        check_spec({ScheduleKind::kGPipe, 2, 1, 0});
      },
      ThrowsMessage<ArgumentError>(HasSubstr("microbatches = 0")));
  EXPECT_THAT(
      [] {
        check_spec({ScheduleKind::kGPipe, 2, 2, 4});
      },
      ThrowsMessage<ArgumentError>(
          AllOf(HasSubstr("stages_per_rank = 2 for gpipe"), HasSubstr("expected 1"))));
  EXPECT_THAT(
      [] {
        check_spec({ScheduleKind::kInterleaved1F1B, 2, 0, 4});
      },
      ThrowsMessage<ArgumentError>(HasSubstr("stages_per_rank = 0 for interleaved")));
  // PyTorch's rounds rule: m a multiple of max(1, m / p).
  EXPECT_THAT(
      [] {
        check_spec({ScheduleKind::kZeroBubble, 4, 2, 9});
      },
      ThrowsMessage<ArgumentError>(AllOf(HasSubstr("microbatches = 9"), HasSubstr("rounds"),
                                         HasSubstr("= 2"), HasSubstr("e.g. 8 or 10"))));
  EXPECT_THAT(
      [] {
        check_spec({ScheduleKind::kGPipe, 4096, 1, 1 << 13});
      },
      ThrowsMessage<ArgumentError>(HasSubstr("at most 16777216")));
  EXPECT_THAT(
      [] {
        check_spec({static_cast<ScheduleKind>(9), 2, 1, 2});
      },
      ThrowsMessage<ArgumentError>(HasSubstr("ScheduleSpec.kind = 9")));
  // Accepted: GPipe with any m >= p; the looped ones with m = 5 on 4 ranks
  // (one round of 5) and m = 10 (two rounds of 5).
  check_spec({ScheduleKind::kGPipe, 4, 1, 7});
  check_spec({ScheduleKind::kInterleaved1F1B, 4, 2, 5});
  check_spec({ScheduleKind::kZeroBubble, 4, 3, 10});
  EXPECT_EQ(microbatches_per_round({ScheduleKind::kZeroBubble, 4, 2, 10}), 5);
  EXPECT_EQ(microbatches_per_round({ScheduleKind::kInterleaved1F1B, 4, 2, 8}), 4);
}

TEST(PpSpec, PlacesStagesInALoop) {
  ScheduleSpec spec{ScheduleKind::kInterleaved1F1B, 4, 2, 8};
  EXPECT_EQ(num_stages(spec), 8);
  EXPECT_EQ(stage_rank(spec, 5), 1);
  EXPECT_EQ(stage_rank(spec, 3), 3);
  EXPECT_THAT(rank_stages(spec, 1), ElementsAre(1, 5));
  EXPECT_THAT([&] { stage_rank(spec, 8); }, ThrowsMessage<ArgumentError>(HasSubstr("stage = 8")));
  EXPECT_THAT([&] { rank_stages(spec, 4); }, ThrowsMessage<ArgumentError>(HasSubstr("rank = 4")));
}

// ---- compute rows --------------------------------------------------------

TEST(PpComputeRows, OneFOneBRunsTheExecutorsOrder) {
  // Schedule1F1B's loop on the last of 4 ranks: forward 0 then backward 0
  // (its _get_pipeline_order() would number these forwards 1..8).
  Rows rows = compute_rows({ScheduleKind::k1F1B, 4, 1, 8});
  EXPECT_EQ(to_csv({rows[3]}), "3F0,3B0,3F1,3B1,3F2,3B2,3F3,3B3,3F4,3B4,3F5,3B5,3F6,3B6,3F7,3B7\n");
  EXPECT_EQ(to_csv({rows[1]}), "1F0,1F1,1F2,1B0,1F3,1B1,1F4,1B2,1F5,1B3,1F6,1B4,1F7,1B5,1B6,1B7\n");
}

TEST(PpComputeRows, ZeroBubbleDefersWeightsByRank) {
  // PyTorch 2.15's InterleavedZeroBubble, p = 4, m = 8, v = 2, rank 3.
  Rows rows = compute_rows({ScheduleKind::kZeroBubble, 4, 2, 8});
  EXPECT_EQ(to_csv({rows[3]}),
            "3F0,3F1,3F2,3F3,7F0,7I0,7F1,7I1,7F2,7I2,7F3,7I3,7W0,3F4,3I0,7W1,3F5,3I1,7W2,3F6,3I2,"
            "7W3,3F7,3I3,3W0,"
            "7F4,7I4,3W1,7F5,7I5,3W2,7F6,7I6,3W3,7F7,7I7,7W4,3I4,7W5,3I5,7W6,3I6,7W7,3I7,3W4,3W5,"
            "3W6,3W7\n");
}

// Forwards before the first backward: GPipe m; 1F1B min(m, p-r);
// interleaved W_r + 1 with W_r = min(v*m, (v-1)*g + 2(p-1-r)); zero bubble
// likewise with factor 1 (capped at v*m).
TEST(PpComputeRows, WarmUpCountsFollowTheFormulas) {
  for (const ScheduleSpec& spec : grid()) {
    Rows rows = compute_rows(spec);
    SimResult sim = simulate(spec, lower(spec, rows));
    int p = spec.ranks, v = spec.stages_per_rank, m = spec.microbatches,
        g = microbatches_per_round(spec);
    for (int r = 0; r < p; ++r) {
      int expected = 0;
      switch (spec.kind) {
        case ScheduleKind::kGPipe:
          expected = m;
          break;
        case ScheduleKind::k1F1B:
          expected = std::min(m, p - r);
          break;
        case ScheduleKind::kInterleaved1F1B:
          expected = std::min(v * m, (v - 1) * g + 2 * (p - 1 - r) + 1);
          break;
        case ScheduleKind::kZeroBubble:
          expected = std::min(v * m, (v - 1) * g + (p - 1 - r) + 1);
          break;
      }
      EXPECT_EQ(sim.forwards_before_first_backward[r], expected) << name(spec) << " rank " << r;
    }
  }
}

// ---- validate ------------------------------------------------------------

TEST(PpValidate, AcceptsEveryGeneratedSchedule) {
  for (const ScheduleSpec& spec : grid()) {
    EXPECT_NO_THROW(validate(spec, compute_rows(spec))) << name(spec);
  }
}

TEST(PpValidate, RejectsBrokenRowsPrecisely) {
  ScheduleSpec one_f_one_b{ScheduleKind::k1F1B, 2, 1, 2};
  ScheduleSpec zero_bubble{ScheduleKind::kZeroBubble, 2, 1, 2};
  auto rejects = [](const ScheduleSpec& spec, const char* csv, auto matcher) {
    EXPECT_THAT([&] { validate(spec, parse_csv(csv)); }, ThrowsMessage<ArgumentError>(matcher))
        << csv;
  };
  // Sanity: the unbroken rows pass.
  validate(one_f_one_b, parse_csv("0F0,0F1,0B0,0B1\n1F0,1B0,1F1,1B1\n"));
  validate(zero_bubble, parse_csv("0F0,0F1,0I0,0W0,0I1,0W1\n1F0,1I0,1F1,1I1,1W0,1W1\n"));
  // A missing B.
  rejects(
      one_f_one_b, "0F0,0F1,0B0,0B1\n1F0,1B0,1F1\n",
      HasSubstr(
          "stage 1, micro-batch 1 has no backward: expected 1B1 (or 1I1 and 1W1) in rank 1's row"));
  // A B before its F.
  rejects(one_f_one_b, "0F0,0B1,0F1,0B0\n1F0,1B0,1F1,1B1\n",
          HasSubstr("rank 0, position 1: 0B1 comes before its forward 0F1"));
  // A W before its I.
  rejects(zero_bubble, "0F0,0F1,0I0,0W1,0W0,0I1\n1F0,1I0,1F1,1I1,1W0,1W1\n",
          HasSubstr("rank 0, position 3: 0W1 comes before its input backward 0I1"));
  // An action on the wrong rank.
  rejects(one_f_one_b, "0F0,0F1,0B0,0B1,1F0\n1B0,1F1,1B1\n",
          HasSubstr("rank 0, position 4: 1F0 is on the wrong rank: stage 1 is held by rank 1"));
  // Twice the same F, a missing F, a missing W, B and I for one backward.
  rejects(one_f_one_b, "0F0,0F1,0F0,0B0,0B1\n1F0,1B0,1F1,1B1\n",
          HasSubstr("rank 0, position 2: 0F0 runs a second time (first at position 0)"));
  rejects(one_f_one_b, "0F0,0B0\n1F0,1B0,1F1,1B1\n",
          HasSubstr("stage 0, micro-batch 1 has no forward"));
  rejects(zero_bubble, "0F0,0F1,0I0,0W0,0I1\n1F0,1I0,1F1,1I1,1W0,1W1\n",
          HasSubstr("stage 0, micro-batch 1 has 0I1 but no 0W1"));
  rejects(zero_bubble, "0F0,0F1,0I0,0W0,0I1,0B1,0W1\n1F0,1I0,1F1,1I1,1W0,1W1\n",
          HasSubstr("both run micro-batch 1's backward of stage 0"));
  // Out of range, lowered actions, the wrong number of rows.
  rejects(one_f_one_b, "0F0,0F1,0B0,0B1,0F2\n1F0,1B0,1F1,1B1\n",
          HasSubstr("micro-batch 2 is out of range"));
  rejects(one_f_one_b, "0F0,0SEND_F0,0F1,0B0,0B1\n1F0,1B0,1F1,1B1\n",
          HasSubstr("0SEND_F0 is not a compute action"));
  rejects(one_f_one_b, "0F0,0F1,0B0,0B1\n", HasSubstr("1 rows for a 1f1b schedule of 2 ranks"));
}

// ---- lower ---------------------------------------------------------------

// (rank, stage, mb, SEND or RECV) -> where a transfer's ends must agree.
struct TransferKey {
  int stage;  // the producer's stage
  bool forward;
  int microbatch;
  bool operator==(const TransferKey& o) const {
    return stage == o.stage && forward == o.forward && microbatch == o.microbatch;
  }
};

TEST(PpLower, PairsTheKthSendWithTheKthRecvOnEveryEdge) {
  for (const ScheduleSpec& spec : grid()) {
    Rows compute = compute_rows(spec);
    Rows lowered = lower(spec, compute);
    std::map<std::pair<int, int>, std::vector<TransferKey>> sends, recvs;
    int transfers = 0;
    for (int rank = 0; rank < spec.ranks; ++rank) {
      std::vector<Action> computes;
      for (size_t i = 0; i < lowered[rank].size(); ++i) {
        const Action& a = lowered[rank][i];
        if (is_compute(a.op)) computes.push_back(a);
        if (a.op == Op::kSendF || a.op == Op::kSendB) {
          bool fwd = a.op == Op::kSendF;
          int peer = stage_rank(spec, fwd ? a.stage + 1 : a.stage - 1);
          ASSERT_NE(peer, rank) << name(spec) << ": a send for a same-rank handoff";
          // Right after its producer.
          ASSERT_GT(i, 0u);
          const Action& before = lowered[rank][i - 1];
          EXPECT_TRUE(before.stage == a.stage && before.microbatch == a.microbatch &&
                      (fwd ? before.op == Op::kForward : is_input_backward(before.op)))
              << name(spec) << ": " << a << " follows " << before;
          sends[{rank, peer}].push_back({a.stage, fwd, a.microbatch});
          ++transfers;
        }
        if (a.op == Op::kRecvF || a.op == Op::kRecvB) {
          bool fwd = a.op == Op::kRecvF;
          int producer = fwd ? a.stage - 1 : a.stage + 1;
          recvs[{stage_rank(spec, producer), rank}].push_back({producer, fwd, a.microbatch});
          // Before its consumer.
          bool consumed_later = false;
          for (size_t j = i + 1; j < lowered[rank].size(); ++j) {
            const Action& c = lowered[rank][j];
            consumed_later |= c.stage == a.stage && c.microbatch == a.microbatch &&
                              (fwd ? c.op == Op::kForward : is_input_backward(c.op));
          }
          EXPECT_TRUE(consumed_later) << name(spec) << ": " << a << " after its consumer";
        }
      }
      EXPECT_EQ(computes, compute[rank])
          << name(spec) << ": lowering reordered rank " << rank << "'s computes";
    }
    EXPECT_TRUE(sends == recvs) << name(spec);
    // Every cross-rank boundary: p*v - 1 boundaries, those between two ranks carry m
    // forward and m backward transfers each.
    int crossing = spec.ranks == 1 ? 0 : num_stages(spec) - 1;
    EXPECT_EQ(transfers, 2 * crossing * spec.microbatches) << name(spec);
  }
}

TEST(PpLower, SameRankHandoffsNeedNoTransfer) {
  ScheduleSpec spec{ScheduleKind::kInterleaved1F1B, 1, 3, 2};
  Rows lowered = lower(spec, compute_rows(spec));
  ASSERT_EQ(lowered.size(), 1u);
  for (const Action& a : lowered[0]) EXPECT_TRUE(is_compute(a.op)) << a;
}

TEST(PpLower, PutsFsdpActionsAroundEachStagesWork) {
  for (ScheduleSpec spec : {ScheduleSpec{ScheduleKind::k1F1B, 4, 1, 8},
                            ScheduleSpec{ScheduleKind::kInterleaved1F1B, 4, 2, 8},
                            ScheduleSpec{ScheduleKind::kZeroBubble, 2, 2, 4}}) {
    Rows compute = compute_rows(spec);
    Rows plain = lower(spec, compute);
    Rows lowered = lower(spec, compute, {/*fsdp=*/true});
    for (int rank = 0; rank < spec.ranks; ++rank) {
      const auto& row = lowered[rank];
      // Without the FSDP actions, the same rows.
      std::vector<Action> rest;
      for (const Action& a : row) {
        if (!is_stage_wide(a.op)) rest.push_back(a);
      }
      EXPECT_EQ(rest, plain[rank]) << name(spec);
      for (int stage : rank_stages(spec, rank)) {
        int first_compute = -1, last_backward = -1, backwards = 0;
        std::vector<int> unshard, reshard, reduce;
        for (size_t i = 0; i < row.size(); ++i) {
          const Action& a = row[i];
          if (a.stage != stage) continue;
          if (is_compute(a.op) && first_compute < 0) first_compute = static_cast<int>(i);
          if (a.op == Op::kBackward || a.op == Op::kBackwardWeight) {
            if (++backwards == spec.microbatches) last_backward = static_cast<int>(i);
          }
          if (a.op == Op::kUnshard) unshard.push_back(static_cast<int>(i));
          if (a.op == Op::kReshard) reshard.push_back(static_cast<int>(i));
          if (a.op == Op::kReduceGrad) reduce.push_back(static_cast<int>(i));
        }
        ASSERT_THAT(unshard, ElementsAre(first_compute - 1)) << name(spec) << " stage " << stage;
        // After the m-th B or W (and the SEND_B of a B, if any): RESHARD, REDUCE_GRAD.
        int after = last_backward + 1;
        if (after < static_cast<int>(row.size()) && row[after].op == Op::kSendB) ++after;
        EXPECT_THAT(reshard, ElementsAre(after)) << name(spec) << " stage " << stage;
        EXPECT_THAT(reduce, ElementsAre(after + 1)) << name(spec) << " stage " << stage;
      }
    }
  }
}

TEST(PpLower, NamesTheStuckActionsOfMalformedRows) {
  // Valid per rank, but rank 0 waits for 0B0's gradient, which rank 1 makes
  // after 1F1, which needs 0F1, which rank 0 runs after 0B0.
  ScheduleSpec spec{ScheduleKind::k1F1B, 2, 1, 2};
  Rows crossed = parse_csv("0F0,0B0,0F1,0B1\n1F1,1F0,1B0,1B1\n");
  EXPECT_NO_THROW(validate(spec, crossed));
  EXPECT_THAT([&] { lower(spec, crossed); },
              ThrowsMessage<ArgumentError>(AllOf(
                  HasSubstr("malformed"), HasSubstr("rank 0 at position 1: 0B0 waits for 0RECV_B0"),
                  HasSubstr("rank 1 at position 0: 1F1 waits for 1RECV_F1"))));
  // Rows that fail validate() fail with validate()'s message.
  EXPECT_THAT([&] { lower(spec, parse_csv("0F0,0F1,0B0,0B1\n1F0,1B0,1F1\n")); },
              ThrowsMessage<ArgumentError>(HasSubstr("has no backward")));
}

// ---- simulate ------------------------------------------------------------

// ---- send wait points ----------------------------------------------------

// The sends posted and not yet waited at once, at most, on each rank.
std::vector<int> most_sends_pending(const Rows& rows, const std::vector<std::vector<int>>& points) {
  std::vector<int> most(rows.size(), 0);
  for (size_t r = 0; r < rows.size(); ++r) {
    std::vector<int> due(rows[r].size(), 0);
    int pending = 0;
    for (size_t i = 0; i < rows[r].size(); ++i) {
      pending -= due[i];
      const Op op = rows[r][i].op;
      if (op != Op::kSendF && op != Op::kSendB) continue;
      ++pending;
      if (points[r][i] != kWaitAtStepEnd) ++due.at(points[r][i]);
      most[r] = std::max(most[r], pending);
    }
  }
  return most;
}

TEST(PpSendWaits, WaitsEachSendAfterTheReceiveThatProvesItArrived) {
  // 1F1B on 2 ranks, 4 micro-batches, worked by hand: rank 0's SEND_F(k)
  // is proven by the gradient of the first micro-batch rank 1 sends after
  // its F(k); rank 1's SEND_B(k) by the next activation rank 0 sends after
  // its B(k), none after B(2) and B(3).
  ScheduleSpec spec{ScheduleKind::k1F1B, 2, 1, 4};
  Rows rows = lower(spec, compute_rows(spec));
  ASSERT_EQ(to_csv(rows),
            "0F0,0SEND_F0,0F1,0SEND_F1,0RECV_B0,0B0,0F2,0SEND_F2,0RECV_B1,0B1,0F3,0SEND_F3,"
            "0RECV_B2,0B2,0RECV_B3,0B3\n"
            "1RECV_F0,1F0,1RECV_F1,1B0,1SEND_B0,1F1,1RECV_F2,1B1,1SEND_B1,1F2,1RECV_F3,1B2,"
            "1SEND_B2,1F3,1B3,1SEND_B3\n");
  const int E = kWaitAtStepEnd;
  EXPECT_THAT(send_wait_points(spec, rows),
              ElementsAre(ElementsAre(E, 5, E, 9, E, E, E, 13, E, E, E, 15, E, E, E, E),
                          ElementsAre(E, E, E, E, 9, E, E, E, 13, E, E, E, E, E, E, E)));
}

TEST(PpSendWaits, EveryPointFollowsThePeersUseOfTheSend) {
  for (const ScheduleSpec& spec : grid()) {
    for (bool fsdp : {false, true}) {
      Rows rows = lower(spec, compute_rows(spec), {fsdp});
      const std::vector<std::vector<int>> points = send_wait_points(spec, rows);
      ASSERT_EQ(points.size(), rows.size());
      // Where in `row` the compute consuming a (stage, micro-batch)'s
      // receive of `kind` (RECV_F or RECV_B) runs.
      auto consumer = [](const std::vector<Action>& row, int stage, int mb, bool forward) {
        for (size_t i = 0; i < row.size(); ++i) {
          const Action& a = row[i];
          if (a.stage == stage && a.microbatch == mb &&
              (forward ? a.op == Op::kForward : is_input_backward(a.op)))
            return static_cast<int>(i);
        }
        return -1;
      };
      for (int r = 0; r < spec.ranks; ++r) {
        ASSERT_EQ(points[r].size(), rows[r].size());
        for (size_t i = 0; i < rows[r].size(); ++i) {
          const Action& send = rows[r][i];
          const bool is_send = send.op == Op::kSendF || send.op == Op::kSendB;
          if (!is_send || points[r][i] == kWaitAtStepEnd) {
            EXPECT_TRUE(is_send || points[r][i] == kWaitAtStepEnd) << name(spec) << " " << send;
            continue;
          }
          const int w = points[r][i];
          ASSERT_GT(w, static_cast<int>(i)) << name(spec) << ": " << send;
          // The point is a compute of this rank fed by the send's peer ...
          const bool fwd = send.op == Op::kSendF;
          const int peer_stage = fwd ? send.stage + 1 : send.stage - 1;
          const int peer = stage_rank(spec, peer_stage);
          const Action& at = rows[r][w];
          const bool at_forward = at.op == Op::kForward;
          ASSERT_TRUE(at_forward || is_input_backward(at.op)) << name(spec) << ": " << at;
          const int from_stage = at_forward ? at.stage - 1 : at.stage + 1;
          ASSERT_EQ(stage_rank(spec, from_stage), peer)
              << name(spec) << ": " << send << " at " << at;
          // ... with what the peer sent after it used the send.
          const int used = consumer(rows[peer], peer_stage, send.microbatch, fwd);
          int sent = -1;
          for (size_t j = 0; j < rows[peer].size(); ++j) {
            const Action& a = rows[peer][j];
            if (a.stage == from_stage && a.microbatch == at.microbatch &&
                a.op == (at_forward ? Op::kSendF : Op::kSendB))
              sent = static_cast<int>(j);
          }
          ASSERT_GE(used, 0) << name(spec) << ": " << send;
          EXPECT_GT(sent, used) << name(spec) << ": " << send << " waited at " << at;
        }
      }
    }
  }
}

TEST(PpSendWaits, PendingSendsDoNotGrowWithMicroBatchesButUnderGPipe) {
  // The buffers a rank has sent and still holds: GPipe holds every
  // micro-batch's gradient on every rank but the first (no activation comes
  // back after the backwards); the others hold as many at 4p micro-batches
  // as at 2p.
  for (ScheduleKind kind : kAllKinds) {
    for (int p : {2, 4}) {
      for (int v : {1, 2}) {
        if (v == 2 && !looped(kind)) continue;
        ScheduleSpec fewer{kind, p, v, 2 * p}, more{kind, p, v, 4 * p};
        const Rows few_rows = lower(fewer, compute_rows(fewer));
        const Rows more_rows = lower(more, compute_rows(more));
        const std::vector<int> few =
            most_sends_pending(few_rows, send_wait_points(fewer, few_rows));
        const std::vector<int> many =
            most_sends_pending(more_rows, send_wait_points(more, more_rows));
        if (kind == ScheduleKind::kGPipe) {
          for (int r = 1; r < p; ++r) EXPECT_EQ(many[r], 4 * p) << name(more) << " rank " << r;
        } else {
          EXPECT_EQ(few, many) << name(more);
          for (int r = 0; r < p; ++r) EXPECT_LE(many[r], 2 * p * v) << name(more) << " rank " << r;
        }
      }
    }
  }
}

TEST(PpSendWaits, RefusesRowsOfAnotherSpec) {
  ScheduleSpec spec{ScheduleKind::k1F1B, 2, 1, 4};
  Rows rows = lower(spec, compute_rows(spec));
  EXPECT_THAT([&] { send_wait_points(ScheduleSpec{ScheduleKind::k1F1B, 3, 1, 4}, rows); },
              ThrowsMessage<ArgumentError>(HasSubstr("2 rows for a schedule of 3 ranks")));
  rows[1].erase(rows[1].begin() + 1);  // 1F0: rank 0's SEND_F0 has no consumer
  EXPECT_THAT([&] { send_wait_points(spec, rows); },
              ThrowsMessage<ArgumentError>(HasSubstr("0SEND_F0 has no consumer of 1RECV_F0")));
}

TEST(PpSimulate, LoweredSchedulesNeverDeadlock) {
  for (const ScheduleSpec& spec : grid()) {
    for (bool fsdp : {false, true}) {
      Rows lowered = lower(spec, compute_rows(spec), {fsdp});
      for (P2PSemantics semantics : {P2PSemantics::kEagerSend, P2PSemantics::kRendezvous}) {
        for (Costs costs : {Costs{}, Costs{1, 2, 1, 0.25}, Costs{2, 1, 1, 0}}) {
          SimResult sim = simulate(spec, lowered, costs, semantics);
          ASSERT_FALSE(sim.deadlock)
              << name(spec) << (fsdp ? " fsdp" : "") << ": " << sim.deadlock_report;
          ASSERT_EQ(sim.idle.size(), static_cast<size_t>(spec.ranks));
          // No rank finishes before it computed v*m*(t_F + t_I + t_W).
          double busy = spec.stages_per_rank * spec.microbatches *
                        (costs.forward + costs.backward_input + costs.backward_weight);
          EXPECT_GE(sim.makespan, busy) << name(spec);
        }
      }
    }
  }
}

// docs/design.md's table: p = 4, m = 8, v = 2 (GPipe and 1F1B v = 1), unit
// costs, free links.
TEST(PpSimulate, ReproducesTheFigures) {
  struct Expected {
    ScheduleSpec spec;
    double idle;
    std::vector<int> forwards_first;
    std::vector<int> peak_live;
  };
  for (const Expected& e :
       {Expected{{ScheduleKind::kGPipe, 4, 1, 8}, 9.0, {8, 8, 8, 8}, {8, 8, 8, 8}},
        Expected{{ScheduleKind::k1F1B, 4, 1, 8}, 9.0, {4, 3, 2, 1}, {4, 3, 2, 1}},
        Expected{{ScheduleKind::kInterleaved1F1B, 4, 2, 8}, 4.5, {11, 9, 7, 5}, {11, 9, 7, 5}},
        Expected{{ScheduleKind::kZeroBubble, 4, 2, 8}, 1.5, {8, 7, 6, 5}, {8, 8, 8, 8}}}) {
    // Stage-equivalents: a looped stage is half a rank's layers.
    Costs costs;
    if (e.spec.stages_per_rank == 2) costs = {0.5, 0.5, 0.5, 0};
    for (P2PSemantics semantics : {P2PSemantics::kEagerSend, P2PSemantics::kRendezvous}) {
      SimResult sim = simulate(e.spec, lower(e.spec, compute_rows(e.spec)), costs, semantics);
      ASSERT_FALSE(sim.deadlock) << sim.deadlock_report;
      for (double idle : sim.idle) EXPECT_DOUBLE_EQ(idle, e.idle) << name(e.spec);
      EXPECT_DOUBLE_EQ(sim.makespan, 24 + e.idle) << name(e.spec);
      EXPECT_EQ(sim.forwards_before_first_backward, e.forwards_first) << name(e.spec);
      EXPECT_EQ(sim.peak_live, e.peak_live) << name(e.spec);
    }
  }
}

TEST(PpSimulate, ZeroBubbleIdlesWithUnevenCosts) {
  // The note under docs/design.md's table: t_I = 2 or t_F = 2 (a stage-equivalent) idles 3.0.
  ScheduleSpec spec{ScheduleKind::kZeroBubble, 4, 2, 8};
  Rows lowered = lower(spec, compute_rows(spec));
  for (Costs costs : {Costs{0.5, 1, 0.5, 0}, Costs{1, 0.5, 0.5, 0}}) {
    SimResult sim = simulate(spec, lowered, costs);
    for (double idle : sim.idle) EXPECT_DOUBLE_EQ(idle, 3.0);
  }
}

TEST(PpSimulate, GPipeAnd1F1BIdleAsTheFormulaSays) {
  for (ScheduleKind kind : {ScheduleKind::kGPipe, ScheduleKind::k1F1B}) {
    for (int p : {2, 3, 4, 8}) {
      for (int m : {p, p + 1, 3 * p}) {
        ScheduleSpec spec{kind, p, 1, m};
        for (Costs costs : {Costs{}, Costs{1, 2, 1, 0}, Costs{0.5, 1.5, 0.25, 0}}) {
          SimResult sim = simulate(spec, lower(spec, compute_rows(spec)), costs);
          double t = costs.forward + costs.backward_input + costs.backward_weight;
          for (double idle : sim.idle) EXPECT_NEAR(idle, (p - 1) * t, 1e-9) << name(spec);
          EXPECT_NEAR(sim.idle[0] / sim.makespan, theoretical_bubble(spec), 1e-12) << name(spec);
        }
      }
    }
  }
}

TEST(PpSimulate, InterleavedIdlesAVthOf1F1B) {
  // (p-1)(t_F+t_B)/v with t_B = 2 t_F, m a multiple of p.
  for (int p : {2, 4, 8}) {
    for (int m : {p, 2 * p}) {
      for (int v : {1, 2, 3}) {
        ScheduleSpec spec{ScheduleKind::kInterleaved1F1B, p, v, m};
        SimResult sim = simulate(spec, lower(spec, compute_rows(spec)));
        for (double idle : sim.idle) EXPECT_NEAR(idle, 3.0 * (p - 1), 1e-9) << name(spec);
        EXPECT_NEAR(sim.idle[0] / sim.makespan, theoretical_bubble(spec), 1e-12) << name(spec);
      }
    }
  }
}

TEST(PpSimulate, TheoreticalBubbles) {
  EXPECT_DOUBLE_EQ(theoretical_bubble({ScheduleKind::kGPipe, 4, 1, 8}), 3.0 / 11);
  EXPECT_DOUBLE_EQ(theoretical_bubble({ScheduleKind::k1F1B, 4, 1, 8}), 3.0 / 11);
  EXPECT_DOUBLE_EQ(theoretical_bubble({ScheduleKind::kInterleaved1F1B, 4, 2, 8}), 3.0 / 19);
  // Zero bubble: the simulator's 1.5 idle of 25.5 (unit costs per looped stage: 3 / 51).
  EXPECT_DOUBLE_EQ(theoretical_bubble({ScheduleKind::kZeroBubble, 4, 2, 8}), 3.0 / 51);
}

TEST(PpSimulate, ReportsCrossedSendsAsADeadlockUnderRendezvous) {
  // Each rank sends before it posts the receive the other one's send needs.
  ScheduleSpec spec{ScheduleKind::k1F1B, 2, 1, 2};
  Rows rows = parse_csv(
      "0F0,0SEND_F0,0F1,0SEND_F1,0RECV_B0,0B0,0RECV_B1,0B1\n"
      "1RECV_F0,1F0,1B0,1SEND_B0,1RECV_F1,1F1,1B1,1SEND_B1\n");
  SimResult eager = simulate(spec, rows, {}, P2PSemantics::kEagerSend);
  EXPECT_FALSE(eager.deadlock) << eager.deadlock_report;
  SimResult rendezvous = simulate(spec, rows, {}, P2PSemantics::kRendezvous);
  EXPECT_TRUE(rendezvous.deadlock);
  EXPECT_THAT(
      rendezvous.deadlock_report,
      AllOf(
          HasSubstr("rendezvous"),
          HasSubstr(
              "rank 0 blocked at position 3, 0SEND_F1: waits for rank 1 to post its 2nd receive"),
          HasSubstr(
              "rank 1 blocked at position 3, 1SEND_B0: waits for rank 0 to post its 1st receive")));
}

TEST(PpSimulate, ReportsCyclicWaitsAsADeadlockUnderBothSemantics) {
  // Rank 0 sends 0F0's output only after 0B0, which needs the gradient of 1F0, which needs that
  // output.
  ScheduleSpec spec{ScheduleKind::kGPipe, 2, 1, 2};
  Rows rows = parse_csv(
      "0F0,0F1,0SEND_F1,0RECV_B0,0B0,0SEND_F0,0RECV_B1,0B1\n"
      "1RECV_F0,1RECV_F1,1F0,1B0,1SEND_B0,1F1,1B1,1SEND_B1\n");
  for (P2PSemantics semantics : {P2PSemantics::kEagerSend, P2PSemantics::kRendezvous}) {
    // The first receive on rank 1 would take 0F1's output: refused before any deadlock.
    EXPECT_THAT([&] { simulate(spec, rows, {}, semantics); },
                ThrowsMessage<ArgumentError>(
                    AllOf(HasSubstr("the 1st transfer from rank 0 to rank 1 pairs 0SEND_F1"),
                          HasSubstr("with 1RECV_F0"))));
  }
  rows = parse_csv(
      "0F0,0F1,0SEND_F1,0RECV_B0,0B0,0SEND_F0,0RECV_B1,0B1\n"
      "1RECV_F1,1RECV_F0,1F0,1B0,1SEND_B0,1F1,1B1,1SEND_B1\n");
  for (P2PSemantics semantics : {P2PSemantics::kEagerSend, P2PSemantics::kRendezvous}) {
    SimResult sim = simulate(spec, rows, {}, semantics);
    EXPECT_TRUE(sim.deadlock);
    EXPECT_THAT(
        sim.deadlock_report,
        AllOf(
            HasSubstr("rank 0 blocked at position 4, 0B0: waits for the data of 0RECV_B0"),
            HasSubstr(
                "rank 1 blocked at position 2, 1F0: waits for the data of 1RECV_F0: rank 0 has not "
                "sent its 2nd transfer to rank 1")));
    EXPECT_TRUE(sim.idle.empty());
    EXPECT_EQ(sim.peak_live, (std::vector<int>{2, 1}));
  }
}

TEST(PpSimulate, ReportsUnpairedTransfers) {
  // A send nobody receives: the ranks finish under eager sends, but the send never completes.
  ScheduleSpec spec{ScheduleKind::kGPipe, 2, 1, 2};
  Rows rows = lower(spec, compute_rows(spec));
  rows[0].push_back(Action{0, Op::kSendF, 1});
  SimResult sim = simulate(spec, rows);
  EXPECT_TRUE(sim.deadlock);
  EXPECT_THAT(sim.deadlock_report,
              HasSubstr("0SEND_F1 (position " + std::to_string(rows[0].size() - 1) +
                        ", its 3rd send to rank 1) is never received"));
}

TEST(PpSimulate, RefusesRowsThatAreNoScheduleOfTheSpec) {
  ScheduleSpec spec{ScheduleKind::k1F1B, 2, 1, 2};
  EXPECT_THAT([&] { simulate(spec, parse_csv("0F0\n1F0\n1F1\n")); },
              ThrowsMessage<ArgumentError>(HasSubstr("3 rows for a schedule of 2 ranks")));
  EXPECT_THAT([&] { simulate(spec, parse_csv("0F0,1F0\n\n")); },
              ThrowsMessage<ArgumentError>(
                  HasSubstr("rank 0, position 1: 1F0: stage 1 is held by rank 1")));
  EXPECT_THAT([&] { simulate(spec, parse_csv("0F0,0SEND_B0\n\n")); },
              ThrowsMessage<ArgumentError>(HasSubstr("stage 0 has no previous stage")));
  EXPECT_THAT(
      [&] {
        simulate(spec, parse_csv("0F0\n\n"), Costs{-1, 1, 1, 0});
      },
      ThrowsMessage<ArgumentError>(HasSubstr("expected finite costs >= 0")));
}

}  // namespace
}  // namespace hp::pp
