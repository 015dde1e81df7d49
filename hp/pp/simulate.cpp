#include "hp/pp/simulate.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

#include "hp/util/error.h"
#include "hp/util/format.h"

namespace hp::pp {

namespace {

constexpr double kNotYet = -1;

// One end of a transfer: the action and when its rank reached it.
struct Endpoint {
  Action action;
  double posted;
  int rank;
  size_t position;
};

// The transfers of one directed rank pair, in the order each side posts them.
struct Edge {
  std::vector<Endpoint> sends;
  std::vector<Endpoint> recvs;
};

// Where a RECV's data comes from: its edge and its index there.
struct RecvSlot {
  int edge = -1;
  size_t index = 0;
};

const char* ordinal_suffix(size_t n) {
  if (n % 100 >= 11 && n % 100 <= 13) return "th";
  switch (n % 10) {
    case 1:
      return "st";
    case 2:
      return "nd";
    case 3:
      return "rd";
    default:
      return "th";
  }
}

std::string nth(size_t index) { return cat(index + 1, ordinal_suffix(index + 1)); }

class Replay {
 public:
  Replay(const ScheduleSpec& spec, const Rows& rows, const Costs& costs, P2PSemantics semantics)
      : spec_(spec),
        rows_(rows),
        costs_(costs),
        semantics_(semantics),
        stages_(num_stages(spec)),
        m_(spec.microbatches),
        forward_done_(cells(), kNotYet),
        input_backward_done_(cells(), kNotYet),
        input_done_(cells(), kNotYet),
        recv_f_(cells()),
        recv_b_(cells()),
        edges_(static_cast<size_t>(spec.ranks) * spec.ranks),
        position_(spec.ranks, 0),
        clock_(spec.ranks, 0),
        busy_(spec.ranks, 0),
        send_posted_(spec.ranks, false) {}

  // Runs every rank as far as it can until none can go on.
  void run() {
    bool progress = true;
    while (progress) {
      progress = false;
      for (int rank = 0; rank < spec_.ranks; ++rank) {
        while (position_[rank] < rows_[rank].size() && step(rank, nullptr)) progress = true;
      }
    }
  }

  bool finished() const {
    for (int rank = 0; rank < spec_.ranks; ++rank) {
      if (position_[rank] < rows_[rank].size()) return false;
    }
    return true;
  }

  // Each unfinished rank's blocked action and what it waits for; after all
  // ranks finished, the transfers that one side posted and the other never did.
  std::string report() {
    std::string out;
    auto add = [&](const std::string& line) { out += cat(out.empty() ? "" : "; ", line); };
    for (int rank = 0; rank < spec_.ranks; ++rank) {
      size_t at = position_[rank];
      if (at == rows_[rank].size()) continue;
      std::string waits_for;
      step(rank, &waits_for);
      add(cat("rank ", rank, " blocked at position ", at, ", ", to_string(rows_[rank][at]),
              ": waits for ", waits_for));
    }
    for (int src = 0; src < spec_.ranks; ++src) {
      for (int dst = 0; dst < spec_.ranks; ++dst) {
        const Edge& e = edges_[edge_index(src, dst)];
        for (size_t k = e.recvs.size(); k < e.sends.size(); ++k) {
          add(cat("rank ", src, "'s ", to_string(e.sends[k].action), " (position ",
                  e.sends[k].position, ", its ", nth(k), " send to rank ", dst,
                  ") is never received"));
        }
        for (size_t k = e.sends.size(); k < e.recvs.size(); ++k) {
          add(cat("rank ", dst, "'s ", to_string(e.recvs[k].action), " (position ",
                  e.recvs[k].position, ", its ", nth(k), " receive from rank ", src,
                  ") is never sent"));
        }
      }
    }
    return out;
  }

  bool unmatched_transfers() const {
    for (const Edge& e : edges_) {
      if (e.sends.size() != e.recvs.size()) return true;
    }
    return false;
  }

  double finish(int rank) const { return clock_[rank]; }
  double busy(int rank) const { return busy_[rank]; }

 private:
  size_t cells() const { return static_cast<size_t>(stages_) * m_; }
  size_t cell(int stage, int mb) const { return static_cast<size_t>(stage) * m_ + mb; }
  size_t edge_index(int src, int dst) const { return static_cast<size_t>(src) * spec_.ranks + dst; }

  // Says why an action cannot run yet: `describe()` builds the text only
  // for a report (run() asks blocked ranks again and again, without one).
  template <typename Describe>
  static bool wait(std::string* why, Describe describe) {
    if (why) *why = describe();
    return false;
  }
  int rank_of(int stage) const { return stage % spec_.ranks; }  // the loop placement (stage_rank)

  // When the data of a posted RECV is there, or kNotYet while its SEND is not posted.
  double arrival(const RecvSlot& slot) const {
    const Edge& e = edges_[slot.edge];
    if (e.sends.size() <= slot.index) return kNotYet;
    double sent = e.sends[slot.index].posted;
    if (semantics_ == P2PSemantics::kRendezvous) sent = std::max(sent, e.recvs[slot.index].posted);
    return sent + costs_.latency;
  }

  // The time the input of compute `a` on `rank` is there, or kNotYet.
  double input_ready(int rank, const Action& a, std::string* why) const {
    const size_t here = cell(a.stage, a.microbatch);
    double ready = 0;
    if (a.op != Op::kForward) {
      // A backward needs its own forward's activations, a W its I.
      double own = a.op == Op::kBackwardWeight ? input_done_[here] : forward_done_[here];
      if (own == kNotYet) {
        Action before{a.stage, a.op == Op::kBackwardWeight ? Op::kBackwardInput : Op::kForward,
                      a.microbatch};
        wait(why, [&] { return cat(to_string(before), ", which has not run on this rank"); });
        return kNotYet;
      }
      ready = own;
      if (a.op == Op::kBackwardWeight) return ready;
    }
    const bool forward = a.op == Op::kForward;
    const int producer = forward ? a.stage - 1 : a.stage + 1;
    if (producer < 0 || producer >= stages_)
      return ready;  // the first stage's input, the last stage's loss
    if (rank_of(producer) == rank) {
      double local = forward ? forward_done_[cell(producer, a.microbatch)]
                             : input_backward_done_[cell(producer, a.microbatch)];
      if (local == kNotYet) {
        wait(why, [&] {
          return cat("the same-rank ",
                     forward ? to_string(Action{producer, Op::kForward, a.microbatch})
                             : cat("backward of stage ", producer, ", micro-batch ", a.microbatch),
                     ", which has not run");
        });
        return kNotYet;
      }
      return std::max(ready, local);
    }
    const RecvSlot& slot = forward ? recv_f_[here] : recv_b_[here];
    Action recv{a.stage, forward ? Op::kRecvF : Op::kRecvB, a.microbatch};
    if (slot.edge < 0) {
      wait(why, [&] { return cat(to_string(recv), ", not posted before it on this rank"); });
      return kNotYet;
    }
    double data = arrival(slot);
    if (data == kNotYet) {
      wait(why, [&] {
        return cat("the data of ", to_string(recv), ": rank ", rank_of(producer),
                   " has not sent its ", nth(slot.index), " transfer to rank ", rank);
      });
      return kNotYet;
    }
    return std::max(ready, data);
  }

  double cost(Op op) const {
    switch (op) {
      case Op::kForward:
        return costs_.forward;
      case Op::kBackward:
        return costs_.backward_input + costs_.backward_weight;
      case Op::kBackwardInput:
        return costs_.backward_input;
      case Op::kBackwardWeight:
        return costs_.backward_weight;
      default:
        return 0;
    }
  }

  void check_pair(int src, int dst, size_t k) const {
    const Edge& e = edges_[edge_index(src, dst)];
    if (k >= e.sends.size() || k >= e.recvs.size()) return;
    const Action& s = e.sends[k].action;
    const Action& r = e.recvs[k].action;
    bool matches = s.microbatch == r.microbatch &&
                   ((s.op == Op::kSendF && r.op == Op::kRecvF && r.stage == s.stage + 1) ||
                    (s.op == Op::kSendB && r.op == Op::kRecvB && r.stage == s.stage - 1));
    if (!matches) {
      throw ArgumentError(
          cat("simulate: the ", nth(k), " transfer from rank ", src, " to rank ", dst, " pairs ",
              to_string(s), " (rank ", src, ", position ", e.sends[k].position, ") with ",
              to_string(r), " (rank ", dst, ", position ", e.recvs[k].position,
              "): c10d pairs the k-th send of a rank pair with the k-th receive, so the "
              "rows would hand one transfer's data to another"));
    }
  }

  // Runs `rank`'s next action if it can; otherwise returns false and says
  // why in *why (when given).
  bool step(int rank, std::string* why) {
    const size_t at = position_[rank];
    const Action& a = rows_[rank][at];
    double& clock = clock_[rank];
    if (is_compute(a.op)) {
      double ready = input_ready(rank, a, why);
      if (ready == kNotYet) return false;
      double start = std::max(clock, ready);
      clock = start + cost(a.op);
      busy_[rank] += cost(a.op);
      const size_t here = cell(a.stage, a.microbatch);
      if (a.op == Op::kForward) forward_done_[here] = clock;
      if (is_input_backward(a.op)) input_backward_done_[here] = clock;
      if (a.op == Op::kBackwardInput) input_done_[here] = clock;
    } else if (a.op == Op::kSendF || a.op == Op::kSendB) {
      const bool forward = a.op == Op::kSendF;
      const size_t here = cell(a.stage, a.microbatch);
      if ((forward ? forward_done_[here] : input_backward_done_[here]) == kNotYet) {
        return wait(why, [&] {
          return cat("its data: ",
                     forward
                         ? to_string(Action{a.stage, Op::kForward, a.microbatch})
                         : cat("the backward of stage ", a.stage, ", micro-batch ", a.microbatch),
                     " has not run on this rank");
        });
      }
      const int dst = rank_of(forward ? a.stage + 1 : a.stage - 1);
      Edge& e = edges_[edge_index(rank, dst)];
      if (!send_posted_[rank]) {
        e.sends.push_back({a, clock, rank, at});
        send_posted_[rank] = true;
        check_pair(rank, dst, e.sends.size() - 1);
      }
      if (semantics_ == P2PSemantics::kRendezvous) {
        size_t k = e.sends.size() - 1;
        if (e.recvs.size() <= k) {
          return wait(why, [&] {
            return cat("rank ", dst, " to post its ", nth(k), " receive from rank ", rank,
                       " (a send completes only once its receive is posted)");
          });
        }
        clock = std::max(clock, e.recvs[k].posted) + costs_.latency;
      }
      send_posted_[rank] = false;
    } else if (a.op == Op::kRecvF || a.op == Op::kRecvB) {
      const bool forward = a.op == Op::kRecvF;
      const int src = rank_of(forward ? a.stage - 1 : a.stage + 1);
      Edge& e = edges_[edge_index(src, rank)];
      e.recvs.push_back({a, clock, rank, at});
      (forward ? recv_f_ : recv_b_)[cell(a.stage, a.microbatch)] = {
          static_cast<int>(edge_index(src, rank)), e.recvs.size() - 1};
      check_pair(src, rank, e.recvs.size() - 1);
    }
    ++position_[rank];
    return true;
  }

  const ScheduleSpec& spec_;
  const Rows& rows_;
  const Costs& costs_;
  const P2PSemantics semantics_;
  const int stages_;
  const int m_;
  // Per (stage, micro-batch): when its F, its B or I, its I finished.
  std::vector<double> forward_done_;
  std::vector<double> input_backward_done_;
  std::vector<double> input_done_;
  // Per (stage, micro-batch) of the consumer: its posted RECV_F, RECV_B.
  std::vector<RecvSlot> recv_f_;
  std::vector<RecvSlot> recv_b_;
  std::vector<Edge> edges_;  // [src * ranks + dst]
  // Per rank: the next action, when the rank is free, its compute time, and
  // whether the SEND at its position is posted but (rendezvous) not done.
  std::vector<size_t> position_;
  std::vector<double> clock_;
  std::vector<double> busy_;
  std::vector<bool> send_posted_;
};

// Refuses what is not a schedule of `spec` at all (as opposed to one that
// merely waits forever).
void check_rows(const ScheduleSpec& spec, const Rows& rows, const Costs& costs) {
  for (double c : {costs.forward, costs.backward_input, costs.backward_weight, costs.latency}) {
    if (!(c >= 0) || !std::isfinite(c)) {
      throw ArgumentError(cat("simulate: Costs{forward = ", costs.forward, ", backward_input = ",
                              costs.backward_input, ", backward_weight = ", costs.backward_weight,
                              ", latency = ", costs.latency, "}: expected finite costs >= 0"));
    }
  }
  const int stages = num_stages(spec);
  if (static_cast<int64_t>(rows.size()) != spec.ranks) {
    throw ArgumentError(cat("simulate: ", rows.size(), " rows for a schedule of ", spec.ranks,
                            " ranks: expected one row per rank"));
  }
  for (int rank = 0; rank < spec.ranks; ++rank) {
    for (size_t i = 0; i < rows[rank].size(); ++i) {
      const Action& a = rows[rank][i];
      auto refuse = [&](const std::string& what) {
        throw ArgumentError(
            cat("simulate: rank ", rank, ", position ", i, ": ", to_string(a), ": ", what));
      };
      if (a.stage < 0 || a.stage >= stages)
        refuse(cat("stage out of range: expected 0 <= stage < ", stages));
      if (stage_rank(spec, a.stage) != rank)
        refuse(cat("stage ", a.stage, " is held by rank ", stage_rank(spec, a.stage)));
      if (is_stage_wide(a.op)) continue;
      if (a.microbatch < 0 || a.microbatch >= spec.microbatches) {
        refuse(cat("micro-batch out of range: expected 0 <= micro-batch < ", spec.microbatches));
      }
      int peer_stage = -1;
      if (a.op == Op::kSendF || a.op == Op::kRecvB) peer_stage = a.stage + 1;
      if (a.op == Op::kSendB || a.op == Op::kRecvF) peer_stage = a.stage - 1;
      if (peer_stage == -1 && !is_compute(a.op))
        refuse("stage 0 has no previous stage to exchange with");
      if (peer_stage >= stages) refuse("the last stage has no next stage to exchange with");
      if (peer_stage >= 0 && stage_rank(spec, peer_stage) == rank) {
        refuse(cat("stage ", peer_stage,
                   " is on the same rank: a same-rank handoff needs no transfer"));
      }
    }
  }
}

// peak_live and forwards_before_first_backward of one row.
void count_activations(const std::vector<Action>& row, int& peak, int& forwards_first) {
  // An I frees nothing: the activations stay for its W.
  int live = 0;
  peak = 0;
  forwards_first = -1;
  int forwards = 0;
  for (const Action& a : row) {
    if (a.op == Op::kForward) {
      ++forwards;
      peak = std::max(peak, ++live);
    } else if (a.op == Op::kBackward || a.op == Op::kBackwardWeight) {
      --live;
    }
    if (forwards_first < 0 && is_input_backward(a.op)) forwards_first = forwards;
  }
  if (forwards_first < 0) forwards_first = forwards;
}

}  // namespace

SimResult simulate(const ScheduleSpec& spec, const Rows& lowered, const Costs& costs,
                   P2PSemantics semantics) {
  check_spec(spec);
  check_rows(spec, lowered, costs);
  SimResult result;
  for (const auto& row : lowered) {
    int peak = 0;
    int forwards_first = 0;
    count_activations(row, peak, forwards_first);
    result.peak_live.push_back(peak);
    result.forwards_before_first_backward.push_back(forwards_first);
  }
  Replay replay(spec, lowered, costs, semantics);
  replay.run();
  if (!replay.finished() || replay.unmatched_transfers()) {
    result.deadlock = true;
    result.deadlock_report =
        cat("deadlock under ",
            semantics == P2PSemantics::kEagerSend ? "eager sends" : "rendezvous sends", ": ",
            replay.report());
    return result;
  }
  for (int rank = 0; rank < spec.ranks; ++rank)
    result.makespan = std::max(result.makespan, replay.finish(rank));
  for (int rank = 0; rank < spec.ranks; ++rank)
    result.idle.push_back(result.makespan - replay.busy(rank));
  return result;
}

}  // namespace hp::pp
