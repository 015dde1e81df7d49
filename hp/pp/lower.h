// Lowering: compute rows (schedule.h) to the rows an executor runs, with the
// point-to-point transfers and, optionally, fully_shard's actions.
//
// Pure: no libtorch, no communication; callable from any thread. Bad rows
// raise hp::ArgumentError (validate()'s messages, or "malformed" naming the
// actions that can never run).
#pragma once

#include "hp/pp/action.h"
#include "hp/pp/schedule.h"

namespace hp::pp {

struct LowerOptions {
  // Add fully_shard's actions per stage and rank: UNSHARD right before the
  // stage's first compute; after its last backward (the m-th B, or the m-th
  // W when the backward is split), RESHARD then REDUCE_GRAD (resharding
  // first frees the gathered parameters before the reduction allocates, as
  // fully_shard's own post-backward does).
  bool fsdp = false;
};

// The compute rows with their transfers:
// - SEND_F right after a forward whose output goes to another rank (the next
//   stage is held elsewhere), and the RECV_F on that rank;
// - SEND_B right after a backward (B or I) of a stage > 0 whose previous
//   stage is held elsewhere, and the RECV_B on that rank.
// A stage whose neighbour is on the same rank hands over without a transfer.
//
// Placement, as PyTorch's _add_send_recv: walk the ranks round-robin in rank
// order, each placing its next compute only once its input is there (its
// RECV already placed on this rank, or the producing compute already placed
// on this rank); placing a compute appends its SEND to its own row and the
// matching RECV to the consumer's row in the same step. Hence every RECV
// precedes its consumer, and on every directed rank pair the k-th SEND and
// the k-th RECV name the same transfer, the pairing c10d applies: rows made
// so cannot deadlock whether sends wait for their receives or not (the
// transfers appear on all ranks in one global order).
//
// Raises hp::ArgumentError when `compute` fails validate(), or with
// "malformed compute rows" naming each rank's stuck action when no rank can
// place its next one (e.g. rank 0 waits for a gradient that rank 1 can only
// make after a forward that rank 0 places later).
Rows lower(const ScheduleSpec& spec, const Rows& compute, const LowerOptions& options = {});

}  // namespace hp::pp
