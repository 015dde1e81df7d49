// The environment a rank starts with: hprun's own, plus the torchrun-style
// variables that tell the rank where it sits in the job (read by
// hp::dist::read_launch_env).
#pragma once

#include <string>
#include <vector>

#include "tools/hprun/options.h"

namespace hp::launcher {

// Returns "NAME=value" entries: every entry of `inherited` (a null-terminated
// array such as environ) except the ones hprun defines, then RANK,
// WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT,
// GROUP_RANK, NODE_RANK, TORCHELASTIC_RESTART_COUNT (`restart_count`, 0 on
// the first attempt) and TORCHELASTIC_MAX_RESTARTS. OpenMPI's OMPI_COMM_WORLD_* are dropped too: when
// hprun itself runs under mpirun they would describe a different world and
// contradict RANK/WORLD_SIZE.
std::vector<std::string> rank_environment(const LaunchOptions& options, int master_port,
                                          int local_rank, int restart_count,
                                          const char* const* inherited);

}  // namespace hp::launcher
