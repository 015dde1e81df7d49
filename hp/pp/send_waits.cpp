#include "hp/pp/send_waits.h"

#include <map>
#include <tuple>

#include "hp/util/error.h"
#include "hp/util/format.h"

namespace hp::pp {

namespace {

// The receive a send is matched with: RECV_F of the next stage, RECV_B of
// the previous one, the same micro-batch.
Action receive_of(const Action& send) {
  return send.op == Op::kSendF ? Action{send.stage + 1, Op::kRecvF, send.microbatch}
                               : Action{send.stage - 1, Op::kRecvB, send.microbatch};
}

bool is_send(Op op) { return op == Op::kSendF || op == Op::kSendB; }

// Per rank, where in its row the compute consuming a receive runs: the
// forward of the receive's (stage, micro-batch) for a RECV_F, its backward
// (B or I) for a RECV_B.
class Consumers {
 public:
  explicit Consumers(const Rows& rows) : index_(rows.size()) {
    for (size_t r = 0; r < rows.size(); ++r) {
      for (size_t i = 0; i < rows[r].size(); ++i) {
        const Action& a = rows[r][i];
        if (a.op == Op::kForward || is_input_backward(a.op))
          index_[r][{a.stage, a.microbatch, a.op == Op::kForward}] = static_cast<int>(i);
      }
    }
  }
  // -1 when rank `r` has no consumer of `recv`.
  int of(size_t r, const Action& recv) const {
    auto it = index_.at(r).find({recv.stage, recv.microbatch, recv.op == Op::kRecvF});
    return it == index_[r].end() ? -1 : it->second;
  }

 private:
  std::vector<std::map<std::tuple<int, int, bool>, int>> index_;
};

}  // namespace

std::vector<std::vector<int>> send_wait_points(const ScheduleSpec& spec, const Rows& rows) {
  if (static_cast<int>(rows.size()) != spec.ranks) {
    throw ArgumentError(cat("send_wait_points: ", rows.size(), " rows for a schedule of ",
                            spec.ranks, " ranks"));
  }
  const Consumers consumers(rows);
  std::vector<std::vector<int>> points(rows.size());
  for (size_t r = 0; r < rows.size(); ++r) {
    const std::vector<Action>& row = rows[r];
    points[r].assign(row.size(), kWaitAtStepEnd);
    for (size_t i = 0; i < row.size(); ++i) {
      const Action& send = row[i];
      if (!is_send(send.op)) continue;
      const Action recv = receive_of(send);
      const int peer = stage_rank(spec, recv.stage);
      const int consumed = consumers.of(peer, recv);
      if (consumed < 0) {
        throw ArgumentError(cat("send_wait_points: rank ", r, "'s ", to_string(send),
                                " has no consumer of ", to_string(recv), " on rank ", peer));
      }
      // Every transfer the peer posts to this rank after that compute.
      int best = kWaitAtStepEnd;
      const std::vector<Action>& peer_row = rows[peer];
      for (size_t j = static_cast<size_t>(consumed) + 1; j < peer_row.size(); ++j) {
        const Action& later = peer_row[j];
        if (!is_send(later.op)) continue;
        const Action back = receive_of(later);
        if (stage_rank(spec, back.stage) != static_cast<int>(r)) continue;
        const int here = consumers.of(r, back);
        if (here < 0) {
          throw ArgumentError(cat("send_wait_points: rank ", peer, "'s ", to_string(later),
                                  " has no consumer of ", to_string(back), " on rank ", r));
        }
        // A consumer before the send would have waited for a transfer that
        // needed this send: no valid rows have one.
        if (here <= static_cast<int>(i)) {
          throw ArgumentError(cat("send_wait_points: rank ", r, " consumes ", to_string(back),
                                  " at ", here, ", before its ", to_string(send), " at ", i,
                                  " that the transfer depends on"));
        }
        if (best == kWaitAtStepEnd || here < best) best = here;
      }
      points[r][i] = best;
    }
  }
  return points;
}

}  // namespace hp::pp
