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

  // Whether `a`'s input is there on `rank` (schedule order within the rank
  // is validate()'s: a backward's own forward, a W's I, came earlier).
  bool ready(const Action& a, std::string* waits_for) const {
    int rank = stage_rank(spec_, a.stage);
    if (a.op == Op::kForward) {
      if (a.stage == 0) return true;
      int producer = a.stage - 1;
      if (stage_rank(spec_, producer) == rank) {
        return at(producer, a.microbatch).forward ||
               explain(waits_for, cat("the same-rank forward ", to_string(Action{producer, Op::kForward, a.microbatch})));
      }
      return at(a.stage, a.microbatch).input_arrives ||
             explain(waits_for, cat(to_string(Action{a.stage, Op::kRecvF, a.microbatch}), " (after ",
                                    to_string(Action{producer, Op::kForward, a.microbatch}), " on rank ",
                                    stage_rank(spec_, producer), ")"));
    }
    if (is_input_backward(a.op)) {
      if (a.stage == stages_ - 1) return true;
      int producer = a.stage + 1;
      if (stage_rank(spec_, producer) == rank) {
        return at(producer, a.microbatch).input_backward ||
               explain(waits_for, cat("the same-rank backward of stage ", producer, ", micro-batch ", a.microbatch));
      }
      return at(a.stage, a.microbatch).grad_arrives ||
             explain(waits_for, cat(to_string(Action{a.stage, Op::kRecvB, a.microbatch}), " (after the backward of ",
                                    "stage ", producer, ", micro-batch ", a.microbatch, " on rank ",
                                    stage_rank(spec_, producer), ")"));
    }
    return true;  // W: its I is earlier in the same row
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
      if (consumer < stages_ && stage_rank(spec_, consumer) != rank) {
        row.push_back({a.stage, Op::kSendF, a.microbatch});
        rows_[stage_rank(spec_, consumer)].push_back({consumer, Op::kRecvF, a.microbatch});
        at(consumer, a.microbatch).input_arrives = true;
      }
    } else if (is_input_backward(a.op)) {
      here.input_backward = true;
      int consumer = a.stage - 1;
      if (consumer >= 0 && stage_rank(spec_, consumer) != rank) {
        row.push_back({a.stage, Op::kSendB, a.microbatch});
        rows_[stage_rank(spec_, consumer)].push_back({consumer, Op::kRecvB, a.microbatch});
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
  static bool explain(std::string* out, std::string text) {
    if (out) *out = std::move(text);
    return false;
  }
  Placed& at(int stage, int mb) { return placed_[static_cast<size_t>(stage) * spec_.microbatches + mb]; }
  const Placed& at(int stage, int mb) const {
    return placed_[static_cast<size_t>(stage) * spec_.microbatches + mb];
  }

  const ScheduleSpec& spec_;
  const LowerOptions& options_;
  const int stages_;
  std::vector<Placed> placed_;
  Rows rows_;
  std::vector<bool> unsharded_;     // per stage: UNSHARD placed
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
        stuck += cat(stuck.empty() ? "" : "; ", "rank ", rank, " at position ", next[rank], ": ", to_string(a),
                     " waits for ", waits_for);
      }
      throw ArgumentError(cat("lower: malformed compute rows for ", to_string(spec.kind), " (", spec.ranks,
                              " ranks): no rank can place its next action: ", stuck,
                              " (each waits for an action another rank places only later)"));
    }
  }
  return lowering.take_rows();
}

}  // namespace hp::pp
