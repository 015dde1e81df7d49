// Where this process sits in the job, read from the launcher's environment.
//
// Two conventions are understood: torchrun's (RANK, WORLD_SIZE, LOCAL_RANK,
// LOCAL_WORLD_SIZE, set by hprun too) and OpenMPI's (OMPI_COMM_WORLD_RANK,
// _SIZE, _LOCAL_RANK, _LOCAL_SIZE). The rendezvous address always comes from
// MASTER_ADDR / MASTER_PORT. Missing, malformed or contradictory variables
// raise ArgumentError naming the variable, its value and what was expected.
#pragma once

#include <functional>
#include <optional>
#include <string>

namespace hp::dist {

struct LaunchEnv {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;
  std::string master_addr;
  int master_port = 0;
  std::string source;  // "torchrun" or "openmpi"
};

// Returns the value of an environment variable, or nullopt when unset.
using EnvLookup = std::function<std::optional<std::string>(const std::string&)>;

// The process environment (getenv).
std::optional<std::string> process_env(const std::string& name);

LaunchEnv read_launch_env(const EnvLookup& lookup = process_env);

// Whether a launcher set this process's rank or world size (in either
// convention). A process started on its own has none and is a world of one.
bool started_by_launcher(const EnvLookup& lookup = process_env);

}  // namespace hp::dist
