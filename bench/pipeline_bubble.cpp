#include "bench/pipeline_bubble.h"

#include "hp/util/error.h"

namespace hp::bench {

using json = nlohmann::json;

MeasuredBubble measured_bubble(const std::vector<std::vector<double>>& compute_s,
                               const std::vector<std::vector<double>>& step_s) {
  HP_CHECK_ARG(!compute_s.empty() && compute_s.size() == step_s.size(),
               "measured_bubble: ", compute_s.size(), " ranks of compute times but ",
               step_s.size(), " of step times");
  MeasuredBubble bubble;
  for (size_t r = 0; r < compute_s.size(); ++r) {
    HP_CHECK_ARG(!compute_s[r].empty() && compute_s[r].size() == step_s[r].size(),
                 "measured_bubble: rank ", r, " has ", compute_s[r].size(),
                 " compute times but ", step_s[r].size(), " step times");
    double sum = 0;
    for (size_t i = 0; i < compute_s[r].size(); ++i)
      sum += step_s[r][i] > 0 ? 1 - compute_s[r][i] / step_s[r][i] : 1;
    bubble.each_rank.push_back(sum / static_cast<double>(compute_s[r].size()));
    bubble.mean += bubble.each_rank.back() / static_cast<double>(compute_s.size());
  }
  return bubble;
}

json summarize_pipeline(const std::vector<json>& runs) {
  const json& last = runs.back()["pipeline"];
  json out;
  for (const char* key : {"schedule", "stages_per_rank", "microbatches", "layers", "bubble_method"})
    out[key] = last[key];
  out["data_parallel"] = last.value("data_parallel", 1);  // pp alone when absent
  out["split"] = last.value("split", json(nullptr));  // how the stages were cut
  std::vector<double> by_round, each_rank;
  for (const json& run : runs) {
    const json& p = run["pipeline"];
    const MeasuredBubble b =
        measured_bubble(p["compute_s_per_rank_per_step"].get<std::vector<std::vector<double>>>(),
                        p["step_s_per_rank_per_step"].get<std::vector<std::vector<double>>>());
    by_round.push_back(b.mean);
    if (each_rank.empty()) each_rank.assign(b.each_rank.size(), 0);
    for (size_t r = 0; r < each_rank.size() && r < b.each_rank.size(); ++r)
      each_rank[r] += b.each_rank[r] / static_cast<double>(runs.size());
  }
  double mean = 0;
  for (double v : by_round) mean += v / static_cast<double>(by_round.size());
  out["measured_bubble"] = mean;
  out["measured_bubble_per_round"] = by_round;
  out["measured_bubble_each_rank"] = each_rank;
  out["theoretical_bubble"] = last.value("theoretical_bubble", json(nullptr));
  out["simulated_bubble"] = last.value("simulated_bubble", json(nullptr));
  return out;
}

}  // namespace hp::bench
