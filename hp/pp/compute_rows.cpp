// The schedule generators (schedule.h says what each rank runs). They follow
// PyTorch 2.15's torch/distributed/pipelining/schedules.py: Schedule1F1B's
// executor loop, and _get_1f1b_rank_ops / _get_warmup_ops for the looped
// schedules. PyTorch pads its lists with idle steps (None) to line the ranks
// up in time; the rows here hold only the actions, in the same order.
#include <algorithm>
#include <deque>

#include "hp/pp/schedule.h"

namespace hp::pp {

namespace {

std::vector<Action> gpipe_row(int rank, int microbatches) {
  std::vector<Action> row;
  for (int mb = 0; mb < microbatches; ++mb) row.push_back({rank, Op::kForward, mb});
  for (int mb = 0; mb < microbatches; ++mb) row.push_back({rank, Op::kBackward, mb});
  return row;
}

// Schedule1F1B._step_microbatches: warm-up forwards (the last rank one, each
// rank before it one more), then backward, forward until the forwards run
// out, then the remaining backwards.
std::vector<Action> one_f_one_b_row(int rank, int ranks, int microbatches) {
  std::vector<Action> row;
  int warmup = std::min(microbatches, ranks - rank);
  int forward = 0;
  int backward = 0;
  while (forward < warmup) row.push_back({rank, Op::kForward, forward++});
  while (backward < microbatches) {
    row.push_back({rank, Op::kBackward, backward++});
    if (forward < microbatches) row.push_back({rank, Op::kForward, forward++});
  }
  return row;
}

// The looped schedules. The rank runs v*m forwards and v*m backwards of its
// v stages; the k-th forward goes to local stage (k div g) mod v, the k-th
// backward to local stage v-1 - ((k div g) mod v), each stage taking its
// micro-batches in order. After `warmup` forwards, each further forward is
// followed by the next backward; then the remaining backwards.
//
// Zero bubble (split backward): each backward is an I, and from the rank's
// (rank+1)-th backward on, every I is followed by the W of the oldest I that
// has none yet (the first `rank` I's wait, which fills the cool-down's
// bubble with weight work); the leftover W's run last.
std::vector<Action> looped_row(const ScheduleSpec& spec, int rank, bool split_backward) {
  const int p = spec.ranks;
  const int v = spec.stages_per_rank;
  const int m = spec.microbatches;
  const int per_round = microbatches_per_round(spec);
  const int hop_factor = split_backward ? 1 : 2;
  const int warmup = std::min(v * m, (v - 1) * per_round + hop_factor * (p - 1 - rank));

  std::vector<int> next_forward_mb(v, 0);
  std::vector<int> next_backward_mb(v, 0);
  std::vector<Action> row;
  std::deque<Action> waiting_for_weight;  // I's whose W has not been placed, oldest first

  auto forward = [&](int k) {
    int local = (k / per_round) % v;
    row.push_back({local * p + rank, Op::kForward, next_forward_mb[local]++});
  };
  auto backward = [&](int k) {
    int local = v - 1 - (k / per_round) % v;
    Action input{local * p + rank, split_backward ? Op::kBackwardInput : Op::kBackward,
                 next_backward_mb[local]++};
    row.push_back(input);
    if (!split_backward) return;
    waiting_for_weight.push_back(input);
    if (k >= rank) {
      Action oldest = waiting_for_weight.front();
      waiting_for_weight.pop_front();
      row.push_back({oldest.stage, Op::kBackwardWeight, oldest.microbatch});
    }
  };

  for (int k = 0; k < warmup; ++k) forward(k);
  for (int k = 0; k < v * m; ++k) {
    if (warmup + k < v * m) forward(warmup + k);
    backward(k);
  }
  for (const Action& input : waiting_for_weight) {
    row.push_back({input.stage, Op::kBackwardWeight, input.microbatch});
  }
  return row;
}

}  // namespace

Rows compute_rows(const ScheduleSpec& spec) {
  check_spec(spec);
  Rows rows;
  for (int rank = 0; rank < spec.ranks; ++rank) {
    switch (spec.kind) {
      case ScheduleKind::kGPipe:
        rows.push_back(gpipe_row(rank, spec.microbatches));
        break;
      case ScheduleKind::k1F1B:
        rows.push_back(one_f_one_b_row(rank, spec.ranks, spec.microbatches));
        break;
      case ScheduleKind::kInterleaved1F1B:
        rows.push_back(looped_row(spec, rank, /*split_backward=*/false));
        break;
      case ScheduleKind::kZeroBubble:
        rows.push_back(looped_row(spec, rank, /*split_backward=*/true));
        break;
    }
  }
  return rows;
}

}  // namespace hp::pp
