// validate(): the per-rank checks of compute rows (schedule.h).
#include <cstdint>
#include <vector>

#include "hp/pp/schedule.h"
#include "hp/util/error.h"
#include "hp/util/format.h"

namespace hp::pp {

namespace {

// Where each action of one (stage, micro-batch) was seen: -1 for not yet.
struct SeenAt {
  int forward = -1;
  int backward = -1;  // B
  int input = -1;     // I
  int weight = -1;    // W
};

std::string position_of(int rank, size_t position, const Action& action) {
  return cat("rank ", rank, ", position ", position, ": ", to_string(action));
}

}  // namespace

void validate(const ScheduleSpec& spec, const Rows& rows) {
  check_spec(spec);
  const int stages = num_stages(spec);
  const int m = spec.microbatches;
  if (static_cast<int64_t>(rows.size()) != spec.ranks) {
    throw ArgumentError(cat("validate: ", rows.size(), " rows for a ", to_string(spec.kind),
                            " schedule of ", spec.ranks, " ranks: expected one row per rank"));
  }
  std::vector<SeenAt> seen(static_cast<size_t>(stages) * m);
  for (int rank = 0; rank < spec.ranks; ++rank) {
    const auto& row = rows[rank];
    for (size_t i = 0; i < row.size(); ++i) {
      const Action& a = row[i];
      if (!is_compute(a.op)) {
        throw ArgumentError(cat("validate: ", position_of(rank, i, a),
                                " is not a compute action: compute rows hold only F, B, I and W "
                                "(lower() adds the others)"));
      }
      if (a.stage < 0 || a.stage >= stages) {
        throw ArgumentError(cat("validate: ", position_of(rank, i, a), ": stage ", a.stage,
                                " is out of range: expected 0 <= stage < ", stages));
      }
      if (a.microbatch < 0 || a.microbatch >= m) {
        throw ArgumentError(cat("validate: ", position_of(rank, i, a), ": micro-batch ",
                                a.microbatch, " is out of range: expected 0 <= micro-batch < ", m));
      }
      int holder = stage_rank(spec, a.stage);
      if (holder != rank) {
        throw ArgumentError(cat("validate: ", position_of(rank, i, a),
                                " is on the wrong rank: stage ", a.stage, " is held by rank ",
                                holder, " (stage mod ranks)"));
      }
      SeenAt& at = seen[static_cast<size_t>(a.stage) * m + a.microbatch];
      auto refuse_second = [&](int first) {
        if (first >= 0) {
          throw ArgumentError(cat("validate: ", position_of(rank, i, a),
                                  " runs a second time (first at position ", first,
                                  "): expected each once"));
        }
      };
      const std::string forward = to_string(Action{a.stage, Op::kForward, a.microbatch});
      switch (a.op) {
        case Op::kForward:
          refuse_second(at.forward);
          at.forward = static_cast<int>(i);
          break;
        case Op::kBackward:
        case Op::kBackwardInput: {
          refuse_second(a.op == Op::kBackward ? at.backward : at.input);
          if (at.forward < 0) {
            throw ArgumentError(cat("validate: ", position_of(rank, i, a),
                                    " comes before its forward ", forward,
                                    ": a backward needs the forward's activations"));
          }
          int other = a.op == Op::kBackward ? at.input : at.backward;
          if (other >= 0) {
            throw ArgumentError(cat("validate: ", position_of(rank, i, a), " and the ",
                                    a.op == Op::kBackward ? "I" : "B", " at position ", other,
                                    " both run micro-batch ", a.microbatch, "'s backward of stage ",
                                    a.stage, ": expected either one B or one I and one W"));
          }
          (a.op == Op::kBackward ? at.backward : at.input) = static_cast<int>(i);
          break;
        }
        case Op::kBackwardWeight:
          refuse_second(at.weight);
          if (at.input < 0) {
            throw ArgumentError(cat("validate: ", position_of(rank, i, a),
                                    " comes before its input backward ",
                                    to_string(Action{a.stage, Op::kBackwardInput, a.microbatch}),
                                    ": W runs after the I of the same micro-batch",
                                    at.backward >= 0 ? " (this one has a full B already)" : ""));
          }
          at.weight = static_cast<int>(i);
          break;
        default:
          break;
      }
    }
  }
  for (int stage = 0; stage < stages; ++stage) {
    for (int mb = 0; mb < m; ++mb) {
      const SeenAt& at = seen[static_cast<size_t>(stage) * m + mb];
      int rank = stage % spec.ranks;
      if (at.forward < 0) {
        throw ArgumentError(
            cat("validate: stage ", stage, ", micro-batch ", mb, " has no forward: expected ",
                to_string(Action{stage, Op::kForward, mb}), " in rank ", rank, "'s row"));
      }
      if (at.backward < 0 && at.input < 0) {
        throw ArgumentError(
            cat("validate: stage ", stage, ", micro-batch ", mb, " has no backward: expected ",
                to_string(Action{stage, Op::kBackward, mb}), " (or ",
                to_string(Action{stage, Op::kBackwardInput, mb}), " and ",
                to_string(Action{stage, Op::kBackwardWeight, mb}), ") in rank ", rank, "'s row"));
      }
      if (at.input >= 0 && at.weight < 0) {
        throw ArgumentError(cat("validate: stage ", stage, ", micro-batch ", mb, " has ",
                                to_string(Action{stage, Op::kBackwardInput, mb}), " but no ",
                                to_string(Action{stage, Op::kBackwardWeight, mb}), " in rank ",
                                rank, "'s row: the weight gradient would never be computed"));
      }
    }
  }
}

}  // namespace hp::pp
