#include "hp/distributed/launch_env.h"

#include <cerrno>
#include <cstdlib>

#include "hp/util/error.h"

namespace hp::dist {
namespace {

constexpr const char* kHowToLaunch =
    "launch with `hprun -n N prog ...` (or torchrun / mpirun), or set RANK, WORLD_SIZE, "
    "MASTER_ADDR and MASTER_PORT";

// Parses a decimal integer in [min, max]; anything else names the variable.
int parse_int(const std::string& name, const std::string& value, long min, long max,
              const char* expected) {
  char* end = nullptr;
  errno = 0;
  long parsed = std::strtol(value.c_str(), &end, 10);
  // Digits only: strtol alone would also take " 7" and "+7".
  HP_CHECK_ARG(!value.empty() && value.find_first_not_of("0123456789") == std::string::npos &&
                   end && *end == '\0' && errno == 0 && parsed >= min && parsed <= max,
               name, " must be ", expected, ", got '", value, "'");
  return static_cast<int>(parsed);
}

// Reads one quantity that either convention may provide; both present and
// different is a contradiction.
std::optional<int> read_pair(const EnvLookup& lookup, const std::string& torch_name,
                             const std::string& mpi_name, long min, long max,
                             const char* expected) {
  auto torch_value = lookup(torch_name);
  auto mpi_value = lookup(mpi_name);
  std::optional<int> a, b;
  if (torch_value) a = parse_int(torch_name, *torch_value, min, max, expected);
  if (mpi_value) b = parse_int(mpi_name, *mpi_value, min, max, expected);
  HP_CHECK_ARG(!(a && b && *a != *b), torch_name, "=", *torch_value, " contradicts ", mpi_name,
               "=", *mpi_value, "; unset one of them");
  return a ? a : b;
}

}  // namespace

std::optional<std::string> process_env(const std::string& name) {
  const char* value = std::getenv(name.c_str());
  if (value == nullptr) return std::nullopt;
  return std::string(value);
}

LaunchEnv read_launch_env(const EnvLookup& lookup) {
  constexpr long kIntMax = 1 << 24;
  LaunchEnv env;
  auto world = read_pair(lookup, "WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", 1, kIntMax,
                         "a positive integer");
  auto rank = read_pair(lookup, "RANK", "OMPI_COMM_WORLD_RANK", 0, kIntMax,
                        "a non-negative integer");
  HP_CHECK_ARG(rank.has_value(), "init_process_group: RANK is not set (nor OMPI_COMM_WORLD_RANK); ",
               kHowToLaunch);
  HP_CHECK_ARG(world.has_value(),
               "init_process_group: WORLD_SIZE is not set (nor OMPI_COMM_WORLD_SIZE) while RANK=",
               *rank, " is; ", kHowToLaunch);
  HP_CHECK_ARG(*rank < *world, "RANK=", *rank, " is out of range for WORLD_SIZE=", *world,
               "; expected 0 <= RANK < WORLD_SIZE");
  env.rank = *rank;
  env.world_size = *world;
  env.source = lookup("RANK") ? "torchrun" : "openmpi";

  auto local_world = read_pair(lookup, "LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", 1,
                               kIntMax, "a positive integer");
  auto local_rank = read_pair(lookup, "LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", 0, kIntMax,
                              "a non-negative integer");
  env.local_world_size = local_world.value_or(env.world_size);
  env.local_rank = local_rank.value_or(env.rank % env.local_world_size);
  HP_CHECK_ARG(env.local_world_size <= env.world_size, "LOCAL_WORLD_SIZE=", env.local_world_size,
               " exceeds WORLD_SIZE=", env.world_size);
  HP_CHECK_ARG(env.local_rank < env.local_world_size, "LOCAL_RANK=", env.local_rank,
               " is out of range for LOCAL_WORLD_SIZE=", env.local_world_size);

  auto addr = lookup("MASTER_ADDR");
  auto port = lookup("MASTER_PORT");
  HP_CHECK_ARG(addr && !addr->empty(),
               "init_process_group: MASTER_ADDR is not set; expected the rendezvous host "
               "(127.0.0.1 for local ranks); ",
               kHowToLaunch);
  HP_CHECK_ARG(port.has_value(),
               "init_process_group: MASTER_PORT is not set; expected the rendezvous TCP port; ",
               kHowToLaunch);
  env.master_addr = *addr;
  env.master_port = parse_int("MASTER_PORT", *port, 1, 65535, "a TCP port in 1..65535");
  if (auto share = lookup("HP_SHARE_GPUS")) {
    env.share_gpus = parse_int("HP_SHARE_GPUS", *share, 0, 1, "0 or 1") == 1;
  }
  return env;
}

bool started_by_launcher(const EnvLookup& lookup) {
  for (const char* name : {"RANK", "WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"}) {
    if (lookup(name)) return true;
  }
  return false;
}

int local_cuda_index(const LaunchEnv& env, int device_count) {
  HP_CHECK_ARG(device_count > 0, "local_cuda_index: device_count must be positive, got ",
               device_count);
  if (env.local_rank < device_count) return env.local_rank;
  HP_CHECK_ARG(env.share_gpus, "LOCAL_RANK=", env.local_rank, " has no GPU of its own: this "
               "machine has ", device_count, " CUDA device(s) for LOCAL_WORLD_SIZE=",
               env.local_world_size, " ranks; expected at most one rank per GPU (launch ",
               device_count, " ranks per node, or set HP_SHARE_GPUS=1 to share GPUs on purpose)");
  return env.local_rank % device_count;
}

std::vector<std::pair<std::string, std::string>> nccl_env_for_shared_gpus(
    const LaunchEnv& env, int device_count, const std::string& hostname,
    const EnvLookup& lookup) {
  std::vector<std::pair<std::string, std::string>> set;
  if (!env.share_gpus || device_count <= 0 || env.local_world_size <= device_count) return set;
  if (!lookup("NCCL_HOSTID")) {
    set.emplace_back("NCCL_HOSTID", cat(hostname, ":hp-local-rank-", env.local_rank));
  }
  // Ranks on other hosts are reached through a real interface, which NCCL
  // picks itself; a job on this host alone needs none but loopback.
  if (env.world_size == env.local_world_size && !lookup("NCCL_SOCKET_IFNAME")) {
    set.emplace_back("NCCL_SOCKET_IFNAME", "lo");
  }
  return set;
}

}  // namespace hp::dist
