// Running the real hp-train binary from a test: alone or on ranks under
// hprun, with the argument lists and the failure description the run tests
// share.
#pragma once

#include <cstdint>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "tests/launcher/process_runner.h"

namespace hp::train::test_run {

using Args = std::vector<std::string>;

inline Args concat(Args a, const Args& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

// The suite's comparisons are derived for the CPU's kernels, so every run
// is on the CPU, also on a machine with a GPU (where hp-train would default
// to it). It goes first: a test's own --device, given later, wins.
inline const Args kOnTheCpu = {"--device", "cpu"};

// hp-train with `args` on `ranks` ranks under hprun, or alone when ranks is 0.
inline launcher::testing::ProcessResult hp_train(int ranks, const Args& args) {
  Args argv = ranks == 0 ? Args{HP_TRAIN_PATH}
                         : Args{HPRUN_PATH, "-n", std::to_string(ranks), HP_TRAIN_PATH};
  argv.insert(argv.end(), kOnTheCpu.begin(), kOnTheCpu.end());
  argv.insert(argv.end(), args.begin(), args.end());
  return launcher::testing::run_process(argv, {"OMP_NUM_THREADS=1"}, /*limit_s=*/120);
}

using launcher::testing::describe;

// hp-train's --seed when none is given.
constexpr uint64_t kDefaultSeed = 1337;

// step -> loss, from the lines hp-train's --log-json wrote to `path`.
inline std::map<int64_t, double> read_losses(const std::string& path) {
  std::map<int64_t, double> out;
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);) {
    const auto j = nlohmann::json::parse(line);
    out[j.at("step").get<int64_t>()] = j.at("loss").get<double>();
  }
  return out;
}

}  // namespace hp::train::test_run
