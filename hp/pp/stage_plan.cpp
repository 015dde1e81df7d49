#include "hp/pp/stage_plan.h"

#include <algorithm>
#include <map>

#include "hp/nn/gpt_config.h"
#include "hp/nn/llama_config.h"
#include "hp/util/error.h"

namespace hp::pp {

namespace {

std::vector<std::string> numbered(const std::string& prefix, int64_t count) {
  std::vector<std::string> names;
  for (int64_t i = 0; i < count; ++i) names.push_back(prefix + std::to_string(i));
  return names;
}

// Stage s's modules when it runs blocks [first, last).
std::vector<std::string> stage_modules(const ModelLayout& layout, int stage, int num_stages,
                                       size_t first, size_t last) {
  std::vector<std::string> modules;
  if (stage == 0) modules = layout.prologue;
  modules.insert(modules.end(), layout.blocks.begin() + first, layout.blocks.begin() + last);
  if (stage == num_stages - 1)
    modules.insert(modules.end(), layout.epilogue.begin(), layout.epilogue.end());
  return modules;
}

std::string block_range(const ModelLayout& layout) {
  return layout.blocks.empty() ? std::string("none")
                               : layout.blocks.front() + " .. " + layout.blocks.back();
}

}  // namespace

ModelLayout gpt_layout(const nn::GPTConfig& config) {
  return {{"wte", "wpe"}, numbered("h.", config.n_layer), {"ln_f", "lm_head"}};
}

ModelLayout llama_layout(const nn::LlamaConfig& config) {
  return {
      {"model.embed_tokens"}, numbered("model.layers.", config.n_layer), {"model.norm", "lm_head"}};
}

int StagePlan::stage_of(const std::string& parameter_name) const {
  int best = -1;
  size_t best_length = 0;
  for (size_t s = 0; s < stages.size(); ++s) {
    for (const std::string& module : stages[s]) {
      const bool prefixes = parameter_name.size() > module.size() &&
                            parameter_name.compare(0, module.size(), module) == 0 &&
                            parameter_name[module.size()] == '.';
      if ((prefixes || parameter_name == module) && module.size() >= best_length) {
        best = static_cast<int>(s);
        best_length = module.size();
      }
    }
  }
  return best;
}

StagePlan plan_stages(const ModelLayout& layout, int num_stages,
                      const std::vector<std::string>& split_points) {
  const size_t n = layout.blocks.size();
  HP_CHECK_ARG(num_stages >= 1, "plan_stages: num_stages ", num_stages, " must be at least 1");
  HP_CHECK_ARG(static_cast<size_t>(num_stages) <= n, "plan_stages: num_stages ", num_stages,
               " exceeds the model's ", n, " blocks (", block_range(layout),
               "): every stage needs at least one block");
  std::vector<size_t> begins;  // first block of each stage
  if (split_points.empty()) {
    // Loads: a stage's blocks plus one for the prologue on stage 0 and one
    // for the epilogue on the last stage. Every stage starts with one block;
    // each further block goes to the least-loaded stage, the earliest on a
    // tie, which gives torchtitan's split whenever its split leaves no
    // stage empty.
    std::vector<size_t> blocks(num_stages, 1), load(num_stages, 1);
    load[0] += 1;
    load[num_stages - 1] += 1;
    for (size_t extra = n - num_stages; extra > 0; --extra) {
      const size_t s = std::min_element(load.begin(), load.end()) - load.begin();
      ++blocks[s];
      ++load[s];
    }
    size_t next = 0;
    for (int s = 0; s < num_stages; ++s) {
      begins.push_back(next);
      next += blocks[s];
    }
  } else {
    HP_CHECK_ARG(split_points.size() == static_cast<size_t>(num_stages - 1),
                 "plan_stages: ", split_points.size(), " split points ", to_string(split_points),
                 " for num_stages ", num_stages, ": expected ", num_stages - 1);
    std::map<std::string, size_t> index;
    for (size_t i = 0; i < n; ++i) index[layout.blocks[i]] = i;
    begins.push_back(0);
    for (const std::string& point : split_points) {
      auto it = index.find(point);
      HP_CHECK_ARG(it != index.end(), "plan_stages: split point '", point,
                   "' names no block of the model (its blocks are ", block_range(layout), ")");
      HP_CHECK_ARG(it->second > 0, "plan_stages: split point '", point,
                   "' is the first block: stage 0 would hold no block");
      HP_CHECK_ARG(it->second > begins.back(), "plan_stages: split point '", point,
                   "' is not after the previous one (", layout.blocks[begins.back()],
                   "): points go in forward order, once each");
      begins.push_back(it->second);
    }
  }
  StagePlan plan;
  for (int s = 0; s < num_stages; ++s) {
    const size_t last = s + 1 < num_stages ? begins[s + 1] : n;
    plan.stages.push_back(stage_modules(layout, s, num_stages, begins[s], last));
  }
  return plan;
}

void check_stage_plan(const ModelLayout& layout, const StagePlan& plan) {
  const int num_stages = plan.num_stages();
  HP_CHECK_ARG(num_stages >= 1, "stage plan: no stages");
  std::vector<std::string> expected = layout.prologue;
  expected.insert(expected.end(), layout.blocks.begin(), layout.blocks.end());
  expected.insert(expected.end(), layout.epilogue.begin(), layout.epilogue.end());
  std::vector<std::string> flat;
  for (int s = 0; s < num_stages; ++s) {
    const auto& modules = plan.stages[s];
    const bool has_block = std::any_of(modules.begin(), modules.end(), [&](const std::string& m) {
      return std::find(layout.blocks.begin(), layout.blocks.end(), m) != layout.blocks.end();
    });
    HP_CHECK_ARG(has_block, "stage plan: stage ", s, " ", to_string(modules), " holds no block (",
                 block_range(layout), ")");
    flat.insert(flat.end(), modules.begin(), modules.end());
  }
  for (size_t i = 0; i < flat.size(); ++i) {
    HP_CHECK_ARG(std::find(expected.begin(), expected.end(), flat[i]) != expected.end(),
                 "stage plan: module '", flat[i], "' is no module of the model (its blocks are ",
                 block_range(layout), ")");
    HP_CHECK_ARG(i < expected.size() && flat[i] == expected[i], "stage plan: module '", flat[i],
                 "' out of place: the stages must hold every module once, in forward order ",
                 "(expected '", i < expected.size() ? expected[i] : std::string("nothing"),
                 "' there)");
  }
  HP_CHECK_ARG(flat.size() == expected.size(), "stage plan: module '", expected[flat.size()],
               "' is in no stage");
  // Every stage has a block and the order is the forward order, so the
  // prologue is in stage 0 and the epilogue in the last.
}

std::string describe(const StagePlan& plan) {
  std::string text;
  for (int s = 0; s < plan.num_stages(); ++s) {
    if (s > 0) text += " | ";
    text += "stage " + std::to_string(s) + ":";
    for (const std::string& m : plan.stages[s]) text += " " + m;
  }
  return text;
}

}  // namespace hp::pp
