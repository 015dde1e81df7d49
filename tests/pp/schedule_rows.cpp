// Prints compute_rows() for one spec as CSV (hp/pp/action.h), for the
// PyTorch oracle (tests/pp/schedule_oracle.py).
// Usage: pp_schedule_rows KIND RANKS STAGES_PER_RANK MICROBATCHES
// Exit status 2 with the message on stderr when the spec is refused.
#include <cstdio>
#include <cstdlib>
#include <string>

#include "hp/pp/schedule.h"
#include "hp/util/error.h"

int main(int argc, char** argv) {
  if (argc != 5) {
    std::fprintf(stderr, "usage: %s KIND RANKS STAGES_PER_RANK MICROBATCHES\n", argv[0]);
    return 1;
  }
  try {
    hp::pp::ScheduleSpec spec{hp::pp::parse_schedule_kind(argv[1]), std::atoi(argv[2]),
                              std::atoi(argv[3]), std::atoi(argv[4])};
    std::fputs(hp::pp::to_csv(hp::pp::compute_rows(spec)).c_str(), stdout);
  } catch (const hp::ArgumentError& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 2;
  }
  return 0;
}
