#include "hp/pp/send_waits.h"

#include <algorithm>
#include <optional>

#include "hp/util/error.h"
#include "hp/util/format.h"

namespace hp::pp {

namespace {

// HP_CHECK_ARG's library half is not linked into the schedule library;
// the message is formatted only on failure.
#define HP_REQUIRE(ok, ...) \
  if (!(ok)) throw ArgumentError(cat("send_wait_points: ", __VA_ARGS__))

// The index in `row` of the compute that consumes transfer `recv` (a RECV_F
// or RECV_B of that row): the forward of its stage and micro-batch, or the
// backward (B or I) that needs the output gradient.
std::optional<int> consumer_of(const std::vector<Action>& row, const Action& recv) {
  for (size_t i = 0; i < row.size(); ++i) {
    const Action& a = row[i];
    if (a.stage != recv.stage || a.microbatch != recv.microbatch) continue;
    if (recv.op == Op::kRecvF && a.op == Op::kForward) return static_cast<int>(i);
    if (recv.op == Op::kRecvB && is_input_backward(a.op)) return static_cast<int>(i);
  }
  return std::nullopt;
}

// The receive a send is matched with: RECV_F of the next stage, RECV_B of
// the previous one, the same micro-batch.
Action receive_of(const Action& send) {
  return send.op == Op::kSendF ? Action{send.stage + 1, Op::kRecvF, send.microbatch}
                               : Action{send.stage - 1, Op::kRecvB, send.microbatch};
}

}  // namespace

std::vector<std::vector<int>> send_wait_points(const ScheduleSpec& spec, const Rows& rows) {
  HP_REQUIRE(static_cast<int>(rows.size()) == spec.ranks, rows.size(), " rows for a schedule of ",
             spec.ranks, " ranks");
  std::vector<std::vector<int>> points(rows.size());
  for (size_t r = 0; r < rows.size(); ++r) {
    const std::vector<Action>& row = rows[r];
    points[r].assign(row.size(), kWaitAtStepEnd);
    for (size_t i = 0; i < row.size(); ++i) {
      const Action& send = row[i];
      if (send.op != Op::kSendF && send.op != Op::kSendB) continue;
      const Action recv = receive_of(send);
      const int peer = stage_rank(spec, recv.stage);
      const std::optional<int> consumed = consumer_of(rows.at(peer), recv);
      HP_REQUIRE(consumed.has_value(), "rank ", r, "'s ", to_string(send), " has no consumer of ",
                 to_string(recv), " on rank ", peer);
      // Every transfer the peer posts to this rank after that compute.
      int best = kWaitAtStepEnd;
      const std::vector<Action>& peer_row = rows[peer];
      for (size_t j = static_cast<size_t>(*consumed) + 1; j < peer_row.size(); ++j) {
        const Action& later = peer_row[j];
        if (later.op != Op::kSendF && later.op != Op::kSendB) continue;
        const Action back = receive_of(later);
        if (stage_rank(spec, back.stage) != static_cast<int>(r)) continue;
        const std::optional<int> here = consumer_of(row, back);
        HP_REQUIRE(here.has_value(), "rank ", peer, "'s ", to_string(later),
                   " has no consumer of ", to_string(back), " on rank ", r);
        // A consumer before the send would have waited for a transfer that
        // needed this send: no valid rows have one.
        HP_REQUIRE(*here > static_cast<int>(i), "rank ", r, " consumes ", to_string(back), " at ",
                   *here, ", before its ", to_string(send), " at ", i,
                   " that the transfer depends on");
        if (best == kWaitAtStepEnd || *here < best) best = *here;
      }
      points[r][i] = best;
    }
  }
  return points;
}

#undef HP_REQUIRE

}  // namespace hp::pp
