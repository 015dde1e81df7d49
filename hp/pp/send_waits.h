// When a pipeline rank may wait for each of its sends without waiting for
// its peer (docs/pipeline.md, "Boundary buffers"): the point that lets the
// executor free a sent activation or gradient during the step instead of
// at its end, and the memory plan model the same.
//
// A send is done once its receiver has it. A rank knows that the receiver
// has it when the receiver sends it something later in its own row than the
// compute that consumed the send (the receiver waited for the send before
// that compute) and the rank has waited for that later transfer. So the
// send can be waited, at no cost, right after the rank's wait for a
// transfer the peer posted after consuming it: the earliest such wait in the
// rank's row is the send's wait point.
//
// Pure: no libtorch, no communication; callable from any thread.
#pragma once

#include <vector>

#include "hp/pp/action.h"
#include "hp/pp/schedule.h"

namespace hp::pp {

constexpr int kWaitAtStepEnd = -1;

// rows: lower()'s rows for `spec`, every rank's. Returns, per rank and per
// index of its row, for a SEND_F or SEND_B the index of the compute (F, B
// or I) in the same row whose received input or output gradient proves the
// send done, or kWaitAtStepEnd when no later transfer from the peer does
// (e.g. GPipe's gradients sent to the previous stage); kWaitAtStepEnd for
// every other action. Raises hp::ArgumentError when a send has no matching
// receive or consumer in the rows (not lower()'s rows for spec).
std::vector<std::vector<int>> send_wait_points(const ScheduleSpec& spec, const Rows& rows);

}  // namespace hp::pp
