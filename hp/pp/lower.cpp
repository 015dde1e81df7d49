#include "hp/pp/lower.h"

#include <vector>

#include "hp/util/error.h"
#include "hp/util/format.h"

namespace hp::pp {

namespace {

// What has been placed so far, per (stage, micro-batch); a stage's actions
// all go to one rank, so "placed" means "placed on the stage's rank".
struct Placed {
  bool forward = false;         // F placed
  bool input_backward = false;  // B or I placed
  bool input_arrives = false;   // RECV_F placed (the stage's input from another rank)
  bool grad_arrives = false;    // RECV_B placed (its output gradient from another rank)
};

class Lowering {
 public:
  Lowering(const ScheduleSpec& spec, const LowerOptions& options)
      : spec_(spec),
        options_(options),
        stages_(num_stages(spec)),
        placed_(static_cast<size_t>(stages_) * spec.microbatches),
        rows_(spec.ranks),
        unsharded_(stages_, false),
        backwards_done_(stages_, 0) {}

  // Whether `a`'s input is there on its rank; if not and `waits_for` is
  // given, what it waits for. (Order within a rank is validate()'s: a
  // backward's own forward, a W's I, came earlier in the same row.)
  bool ready(const Action& a, std::string* waits_for) const {
    const bool forward = a.op == Op::kForward;
    if (!forward && !is_input_backward(a.op)) return true;  // W
    const int producer = forward ? a.stage - 1 : a.stage + 1;
    if (producer < 0 || producer >= stages_)
      return true;  // the first stage's input, the last stage's loss
    const int mb = a.microbatch;
    const bool same_rank = rank_of(producer) == rank_of(a.stage);
    bool there = false;
    if (same_rank) {
      there = forward ? at(producer, mb).forward : at(producer, mb).input_backward;
    } else {
      there = forward ? at(a.stage, mb).input_arrives : at(a.stage, mb).grad_arrives;
    }
    if (!there && waits_for) {
      std::string producing = forward
                                  ? to_string(Action{producer, Op::kForward, mb})
                                  : cat("the backward of stage ", producer, ", micro-batch ", mb);
      *waits_for = same_rank
                       ? cat("the same-rank ", producing)
                       : cat(to_string(Action{a.stage, forward ? Op::kRecvF : Op::kRecvB, mb}),
                             " (after ", producing, " on rank ", rank_of(producer), ")");
    }
    return there;
  }

  void place(int rank, const Action& a) {
    auto& row = rows_[rank];
    if (options_.fsdp && !unsharded_[a.stage]) {
      row.push_back({a.stage, Op::kUnshard, -1});
      unsharded_[a.stage] = true;
    }
    row.push_back(a);
    Placed& here = at(a.stage, a.microbatch);
    if (a.op == Op::kForward) {
      here.forward = true;
      int consumer = a.stage + 1;
      if (consumer < stages_ && rank_of(consumer) != rank) {
        row.push_back({a.stage, Op::kSendF, a.microbatch});
        rows_[rank_of(consumer)].push_back({consumer, Op::kRecvF, a.microbatch});
        at(consumer, a.microbatch).input_arrives = true;
      }
    } else if (is_input_backward(a.op)) {
      here.input_backward = true;
      int consumer = a.stage - 1;
      if (consumer >= 0 && rank_of(consumer) != rank) {
        row.push_back({a.stage, Op::kSendB, a.microbatch});
        rows_[rank_of(consumer)].push_back({consumer, Op::kRecvB, a.microbatch});
        at(consumer, a.microbatch).grad_arrives = true;
      }
    }
    // The stage's gradients are complete after its m-th B or W (an I leaves
    // the weight gradient to its W).
    if (options_.fsdp && (a.op == Op::kBackward || a.op == Op::kBackwardWeight) &&
        ++backwards_done_[a.stage] == spec_.microbatches) {
      row.push_back({a.stage, Op::kReshard, -1});
      row.push_back({a.stage, Op::kReduceGrad, -1});
    }
  }

  Rows take_rows() { return std::move(rows_); }

 private:
  int rank_of(int stage) const { return stage % spec_.ranks; }  // the loop placement (stage_rank)
  Placed& at(int stage, int mb) {
    return placed_[static_cast<size_t>(stage) * spec_.microbatches + mb];
  }
  const Placed& at(int stage, int mb) const {
    return placed_[static_cast<size_t>(stage) * spec_.microbatches + mb];
  }

  const ScheduleSpec& spec_;
  const LowerOptions& options_;
  const int stages_;
  std::vector<Placed> placed_;
  Rows rows_;
  std::vector<bool> unsharded_;      // per stage: UNSHARD placed
  std::vector<int> backwards_done_;  // per stage: B and W placed
};

}  // namespace

Rows lower(const ScheduleSpec& spec, const Rows& compute, const LowerOptions& options) {
  validate(spec, compute);
  Lowering lowering(spec, options);
  std::vector<size_t> next(spec.ranks, 0);
  size_t remaining = 0;
  for (const auto& row : compute) remaining += row.size();
  while (remaining > 0) {
    bool progress = false;
    for (int rank = 0; rank < spec.ranks; ++rank) {
      if (next[rank] == compute[rank].size()) continue;
      const Action& a = compute[rank][next[rank]];
      if (!lowering.ready(a, nullptr)) continue;
      lowering.place(rank, a);
      ++next[rank];
      --remaining;
      progress = true;
    }
    if (!progress) {
      std::string stuck;
      for (int rank = 0; rank < spec.ranks; ++rank) {
        if (next[rank] == compute[rank].size()) continue;
        const Action& a = compute[rank][next[rank]];
        std::string waits_for;
        lowering.ready(a, &waits_for);
        stuck += cat(stuck.empty() ? "" : "; ", "rank ", rank, " at position ", next[rank], ": ",
                     to_string(a), " waits for ", waits_for);
      }
      throw ArgumentError(cat("lower: malformed compute rows for ", to_string(spec.kind), " (",
                              spec.ranks, " ranks): no rank can place its next action: ", stuck,
                              " (each waits for an action another rank places only later)"));
    }
  }
  return lowering.take_rows();
}

}  // namespace hp::pp
