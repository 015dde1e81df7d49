// Running the real hp-train binary from a test: alone or on ranks under
// hprun, with the argument lists and the failure description the run tests
// share.
#pragma once

#include <string>
#include <vector>

#include "tests/launcher/process_runner.h"

namespace hp::train::test_run {

using Args = std::vector<std::string>;

inline Args concat(Args a, const Args& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

// hp-train with `args` on `ranks` ranks under hprun, or alone when ranks is 0.
inline launcher::testing::ProcessResult hp_train(int ranks, const Args& args) {
  Args argv = ranks == 0 ? Args{HP_TRAIN_PATH}
                         : Args{HPRUN_PATH, "-n", std::to_string(ranks), HP_TRAIN_PATH};
  argv.insert(argv.end(), args.begin(), args.end());
  return launcher::testing::run_process(argv, {"OMP_NUM_THREADS=1"}, /*limit_s=*/120);
}

using launcher::testing::describe;

}  // namespace hp::train::test_run
