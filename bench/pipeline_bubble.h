// The measured bubble of hp-bench's pipeline rows (ours and PyTorch's):
// how much of each rank's pipeline step is not spent computing, from the
// per-rank, per-step times each worker reports. Pure functions.
//
// A worker's result carries "pipeline": {schedule, stages_per_rank,
// microbatches, layers, compute_s_per_rank_per_step, step_s_per_rank_per_step,
// bubble_method} and, ours only, theoretical_bubble and simulated_bubble
// (hp::pp's figures for the schedule).
#pragma once

#include <nlohmann/json.hpp>
#include <vector>

namespace hp::bench {

struct MeasuredBubble {
  double mean = 0;                // over the ranks
  std::vector<double> each_rank;  // 1 - compute_s / step_s, mean over the rank's steps
};

// compute_s[r][i], step_s[r][i]: rank r's compute time and pipeline step
// time in step i. A step of zero length counts as all bubble. Throws
// hp::ArgumentError when the shapes disagree or are empty.
MeasuredBubble measured_bubble(const std::vector<std::vector<double>>& compute_s,
                               const std::vector<std::vector<double>>& step_s);

// The report row's "pipeline" object from a pipeline row's rounds: the
// schedule (the last round's, with its data_parallel degree, 1 when the
// worker gave none, and its stage split, null when none), the measured bubble (each round's, their
// mean, and per rank the mean over the rounds), the method, and ours'
// theoretical and simulated bubble.
nlohmann::json summarize_pipeline(const std::vector<nlohmann::json>& runs);

}  // namespace hp::bench
