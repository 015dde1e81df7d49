// A replay of lowered rows (lower.h) in simulated time: whether the ranks
// can run them to the end, and if so how long a step takes, how long each
// rank idles and how many micro-batches' activations each rank holds at once
// (the memory plan's input).
//
// The model. Each rank runs its row in order, one action at a time. A compute
// costs its Costs time (B = I + W) and starts once the rank is free and its
// input is there: for a forward of stage s > 0, the output of F(s-1) (on
// this rank, or the data of this rank's RECV_F); for a B or I of stage s <
// last, the input gradient of stage s+1 (likewise through RECV_B); a
// backward also needs its own F, a W its I, on this rank. A RECV posts a
// receive and takes no time; the compute that consumes it waits for the
// data (as an executor waits on the receive's Work just before the compute).
// Transfers pair as c10d pairs them: the k-th SEND from rank a to rank b
// with the k-th RECV on b from a. Under kEagerSend a SEND takes no time and
// its data is there `latency` after it; under kRendezvous the sender waits
// until the matching RECV is posted, and the data arrives `latency` after
// both are posted. UNSHARD, RESHARD and REDUCE_GRAD take no time here.
//
// Pure: no libtorch, no communication; callable from any thread.
#pragma once

#include <string>
#include <vector>

#include "hp/pp/action.h"
#include "hp/pp/schedule.h"

namespace hp::pp {

struct Costs {
  double forward = 1;          // t_F
  double backward_input = 1;   // t_I
  double backward_weight = 1;  // t_W; a full backward B costs t_I + t_W
  double latency = 0;          // per transfer
};

enum class P2PSemantics {
  kEagerSend,   // Gloo: a send completes without the receiver
  kRendezvous,  // a send blocks until its recv is posted (unbatched NCCL)
};

struct SimResult {
  // No rank could go on before all finished. deadlock_report then names
  // each unfinished rank's blocked action, its position in the row and what
  // it waits for; makespan and idle are 0 and empty.
  bool deadlock = false;
  std::string deadlock_report;
  double makespan = 0;       // when the last rank finishes
  std::vector<double> idle;  // per rank: makespan - its compute time
  // Per rank, from the row's order alone (also filled on a deadlock):
  // the most (stage, micro-batch) activations live at once, each from its F
  // until its B, or until its W when the backward is split;
  std::vector<int> peak_live;
  // the number of F before the rank's first B or I.
  std::vector<int> forwards_before_first_backward;
};

// Replays `lowered` (one row per rank). Raises hp::ArgumentError for rows
// that do not fit the spec (a row count other than ranks, a stage out of
// range or on another rank, a micro-batch out of range, a SEND_F of the last
// stage or a SEND_B of stage 0, a transfer between two stages of one rank),
// for transfers whose k-th SEND and k-th RECV on a rank pair disagree (they
// would pass each other's data) and for negative or non-finite costs. Rows
// that merely wait forever are a deadlock, reported in the result.
SimResult simulate(const ScheduleSpec& spec, const Rows& lowered, const Costs& costs = {},
                   P2PSemantics semantics = P2PSemantics::kEagerSend);

}  // namespace hp::pp
