// The spec, its checks, the loop placement and the bubble figures. The
// generators are in compute_rows.cpp, the checks of rows in validate.cpp.
#include "hp/pp/schedule.h"

#include <algorithm>
#include <cstdint>
#include <numeric>

#include "hp/pp/lower.h"
#include "hp/pp/simulate.h"
#include "hp/util/error.h"
#include "hp/util/format.h"

namespace hp::pp {

namespace {

struct KindName {
  ScheduleKind kind;
  const char* name;
};

constexpr KindName kKindNames[] = {
    {ScheduleKind::kGPipe, "gpipe"},
    {ScheduleKind::k1F1B, "1f1b"},
    {ScheduleKind::kInterleaved1F1B, "interleaved"},
    {ScheduleKind::kZeroBubble, "zero-bubble"},
};

bool is_looped(ScheduleKind kind) {
  return kind == ScheduleKind::kInterleaved1F1B || kind == ScheduleKind::kZeroBubble;
}

// Sane upper bound on the rows' size (see check_spec).
constexpr int64_t kMaxStageMicrobatches = int64_t{1} << 24;

}  // namespace

const char* to_string(ScheduleKind kind) {
  for (const KindName& entry : kKindNames) {
    if (entry.kind == kind) return entry.name;
  }
  return "?";
}

ScheduleKind parse_schedule_kind(std::string_view name) {
  for (const KindName& entry : kKindNames) {
    if (name == entry.name) return entry.kind;
  }
  throw ArgumentError(cat("schedule kind '", name,
                          "' is unknown: expected gpipe, 1f1b, interleaved or zero-bubble"));
}

void check_spec(const ScheduleSpec& spec) {
  bool known = false;
  for (const KindName& entry : kKindNames) known = known || entry.kind == spec.kind;
  if (!known) {
    throw ArgumentError(cat("ScheduleSpec.kind = ", static_cast<int>(spec.kind),
                            ": expected gpipe, 1f1b, interleaved or zero-bubble"));
  }
  const char* kind = to_string(spec.kind);
  if (spec.ranks < 1) {
    throw ArgumentError(
        cat("ScheduleSpec.ranks = ", spec.ranks, ": expected at least 1 pipeline rank"));
  }
  if (spec.microbatches < 1) {
    throw ArgumentError(cat("ScheduleSpec.microbatches = ", spec.microbatches,
                            ": expected at least 1 micro-batch"));
  }
  if (spec.microbatches < spec.ranks) {
    throw ArgumentError(cat("ScheduleSpec.microbatches = ", spec.microbatches,
                            " is fewer than ScheduleSpec.ranks = ", spec.ranks,
                            ": expected microbatches >= ranks (a ", kind, " pipeline of ",
                            spec.ranks, " ranks needs at least ", spec.ranks,
                            " micro-batches to keep every rank busy)"));
  }
  if (is_looped(spec.kind)) {
    if (spec.stages_per_rank < 1) {
      throw ArgumentError(cat("ScheduleSpec.stages_per_rank = ", spec.stages_per_rank, " for ",
                              kind, ": expected at least 1 (usually 2)"));
    }
    int rounds = std::max(1, spec.microbatches / spec.ranks);
    if (spec.microbatches % rounds != 0) {
      throw ArgumentError(cat(
          "ScheduleSpec.microbatches = ", spec.microbatches, " for ", kind,
          " with ranks = ", spec.ranks,
          ": expected a multiple of the number of rounds max(1, microbatches / ranks) = ", rounds,
          " (as PyTorch's looped schedules require), e.g. ",
          spec.microbatches - spec.microbatches % rounds, " or ",
          spec.microbatches - spec.microbatches % rounds + rounds));
    }
  } else if (spec.stages_per_rank != 1) {
    throw ArgumentError(cat("ScheduleSpec.stages_per_rank = ", spec.stages_per_rank, " for ", kind,
                            ": expected 1 (one stage per rank; interleaved and zero-bubble loop "
                            "several stages per rank)"));
  }
  int64_t pairs = int64_t{spec.ranks} * spec.stages_per_rank * spec.microbatches;
  if (pairs > kMaxStageMicrobatches) {
    throw ArgumentError(cat("ScheduleSpec: ranks * stages_per_rank * microbatches = ", spec.ranks,
                            " * ", spec.stages_per_rank, " * ", spec.microbatches, " = ", pairs,
                            ": expected at most ", kMaxStageMicrobatches,
                            " (stage, micro-batch) pairs"));
  }
}

int microbatches_per_round(const ScheduleSpec& spec) {
  check_spec(spec);
  if (!is_looped(spec.kind)) return spec.microbatches;
  return spec.microbatches / std::max(1, spec.microbatches / spec.ranks);
}

int num_stages(const ScheduleSpec& spec) {
  check_spec(spec);
  return spec.ranks * spec.stages_per_rank;
}

int stage_rank(const ScheduleSpec& spec, int stage) {
  int stages = num_stages(spec);
  if (stage < 0 || stage >= stages) {
    throw ArgumentError(cat("stage = ", stage, ": expected 0 <= stage < ", stages, " (", spec.ranks,
                            " ranks x ", spec.stages_per_rank, " stages per rank)"));
  }
  return stage % spec.ranks;
}

std::vector<int> rank_stages(const ScheduleSpec& spec, int rank) {
  check_spec(spec);
  if (rank < 0 || rank >= spec.ranks) {
    throw ArgumentError(cat("rank = ", rank, ": expected 0 <= rank < ", spec.ranks));
  }
  std::vector<int> stages;
  for (int local = 0; local < spec.stages_per_rank; ++local)
    stages.push_back(local * spec.ranks + rank);
  return stages;
}

double theoretical_bubble(const ScheduleSpec& spec) {
  check_spec(spec);
  double p = spec.ranks;
  double m = spec.microbatches;
  double v = spec.stages_per_rank;
  switch (spec.kind) {
    case ScheduleKind::kGPipe:
    case ScheduleKind::k1F1B:
      return (p - 1) / (m + p - 1);
    case ScheduleKind::kInterleaved1F1B:
      return (p - 1) / (v * m + p - 1);
    case ScheduleKind::kZeroBubble: {
      SimResult sim = simulate(spec, lower(spec, compute_rows(spec)));
      double idle = std::accumulate(sim.idle.begin(), sim.idle.end(), 0.0) / p;
      return idle / sim.makespan;
    }
  }
  return 0;  // unreachable: check_spec refuses other kinds
}

}  // namespace hp::pp
