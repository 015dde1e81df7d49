// Pipeline schedules as per-rank lists of compute actions, the same lists
// PyTorch 2.15's torch.distributed.pipelining runs (docs/design.md,
// "Pipeline schedules").
//
// p = ranks, v = stages_per_rank, m = microbatches; the model is cut into
// p * v stages. GPipe and 1F1B hold one stage per rank (stage r on rank r);
// the looped schedules (interleaved 1F1B, interleaved zero bubble) hold v
// stages per rank, stage s on rank s mod p.
//
// Pure functions of their arguments: no libtorch, no communication, no
// shared state; callable from any thread. Every bad argument raises
// hp::ArgumentError naming the argument, its value and what was expected.
#pragma once

#include <string_view>
#include <vector>

#include "hp/pp/action.h"

namespace hp::pp {

enum class ScheduleKind {
  kGPipe,            // all forwards, then all backwards
  k1F1B,             // warm-up forwards, then one forward / one backward
  kInterleaved1F1B,  // 1F1B over v looped stages per rank
  kZeroBubble,       // interleaved zero bubble (ZB1P): backward split into I and W
};

// "gpipe", "1f1b", "interleaved", "zero-bubble".
const char* to_string(ScheduleKind kind);
ScheduleKind parse_schedule_kind(std::string_view name);

struct ScheduleSpec {
  ScheduleKind kind;
  int ranks;            // p, pipeline ranks
  int stages_per_rank;  // v: 1 for GPipe and 1F1B; the looped schedules take >= 1 (usually 2)
  int microbatches;     // m
};

// Refuses a spec the schedule cannot run:
// - ranks >= 1, stages_per_rank >= 1 (exactly 1 for GPipe and 1F1B);
// - microbatches >= ranks (fewer cannot fill the pipeline; PyTorch refuses
//   this for 1F1B and accepts it elsewhere, here it is refused everywhere);
// - for the looped schedules, microbatches a multiple of the number of rounds
//   max(1, microbatches / ranks), as PyTorch requires (microbatches_per_round);
// - at most 2^24 (stage, micro-batch) pairs, so that rows stay a sane size.
void check_spec(const ScheduleSpec& spec);

// For the looped schedules: micro-batches per round g = m / max(1, m / p)
// (m a multiple of p gives g = p). A rank runs g micro-batches through one of
// its stages before it moves to the next. GPipe and 1F1B: m.
int microbatches_per_round(const ScheduleSpec& spec);

int num_stages(const ScheduleSpec& spec);                          // ranks * stages_per_rank
int stage_rank(const ScheduleSpec& spec, int stage);               // stage mod ranks
std::vector<int> rank_stages(const ScheduleSpec& spec, int rank);  // ascending

// The compute actions of every rank in execution order: F and B, or F, I and
// W for the zero-bubble schedule. No sends, receives or FSDP actions (lower()
// adds them). What each rank runs:
// - GPipe: F0..F(m-1), then B0..B(m-1).
// - 1F1B: min(m, p - r) forwards, then B, F pairs, then the remaining B.
//   This is the order Schedule1F1B's executor runs (PyTorch's
//   _get_pipeline_order() for 1F1B numbers the last rank's forwards 1..m).
// - Interleaved 1F1B: W_r = min(v*m, (v-1)*g + 2*(p-1-r)) warm-up forwards,
//   then F, B pairs, then the remaining B. The k-th forward of the rank runs
//   local stage (k div g) mod v, the k-th backward local stage
//   v-1 - ((k div g) mod v); micro-batches in order per stage.
// - Zero bubble: as interleaved with W_r = min(v*m, (v-1)*g + (p-1-r)) and I
//   instead of B; from the rank's (r+1)-th backward on, each I is followed by
//   the W of the oldest I still without one; the remaining W come last.
Rows compute_rows(const ScheduleSpec& spec);

// Checks compute rows (as compute_rows() makes, or from a CSV) for the spec:
// one row per rank; only F, B, I and W; stages and micro-batches in range;
// every action on the rank that holds its stage; for every (stage,
// micro-batch) one F and either one B or one I and one W, F before B and I,
// I before W. Raises hp::ArgumentError naming the rank, the position and the
// action, or the stage and micro-batch that lacks an action. Whether the
// ranks' orders fit together (a stage's forward waiting on the previous
// stage's) is lower()'s and simulate()'s question.
void validate(const ScheduleSpec& spec, const Rows& rows);

// The fraction of a step a rank is idle, with free communication:
// - GPipe, 1F1B: (p-1) / (m+p-1);
// - interleaved 1F1B: (p-1) / (v*m+p-1) (exact when t_B = 2 t_F, as the
//   schedule assumes; with v = 1 it is 1F1B's);
// - zero bubble: no closed formula; the simulator's figure for the lowered
//   compute_rows() with t_F = t_I = t_W = 1 and free links: mean idle time over
//   the ranks divided by the makespan (simulate.h).
double theoretical_bubble(const ScheduleSpec& spec);

}  // namespace hp::pp
