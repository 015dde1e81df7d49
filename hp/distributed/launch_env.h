// Where this process sits in the job, read from the launcher's environment.
//
// Two conventions are understood: torchrun's (RANK, WORLD_SIZE, LOCAL_RANK,
// LOCAL_WORLD_SIZE, set by hprun too) and OpenMPI's (OMPI_COMM_WORLD_RANK,
// _SIZE, _LOCAL_RANK, _LOCAL_SIZE). The rendezvous address always comes from
// MASTER_ADDR / MASTER_PORT. Missing, malformed or contradictory variables
// raise ArgumentError naming the variable, its value and what was expected.
//
// Which GPU a process uses follows from the same environment: one GPU per
// local rank (local_cuda_index below).
#pragma once

#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace hp::dist {

struct LaunchEnv {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;
  std::string master_addr;
  int master_port = 0;
  std::string source;  // "torchrun" or "openmpi"
  // HP_SHARE_GPUS=1: several local ranks may use one GPU on purpose (tests
  // of a multi-rank job on a machine with fewer GPUs).
  bool share_gpus = false;
};

// Returns the value of an environment variable, or nullopt when unset.
using EnvLookup = std::function<std::optional<std::string>(const std::string&)>;

// The process environment (getenv).
std::optional<std::string> process_env(const std::string& name);

LaunchEnv read_launch_env(const EnvLookup& lookup = process_env);

// Whether a launcher set this process's rank or world size (in either
// convention). A process started on its own has none and is a world of one.
bool started_by_launcher(const EnvLookup& lookup = process_env);

// The index of the GPU this local rank uses among `device_count` (> 0):
// LOCAL_RANK itself. More local ranks than GPUs raise ArgumentError unless
// env.share_gpus, which maps LOCAL_RANK % device_count: two ranks on one GPU
// by accident halve its memory and, over NCCL, fail inside the first
// collective ("Duplicate GPU detected"), so sharing has to be asked for.
int local_cuda_index(const LaunchEnv& env, int device_count);

// The NCCL variables that let local ranks share a GPU (env.share_gpus with
// more local ranks than the `device_count` GPUs): NCCL refuses two ranks
// with the same host hash on one device ("Duplicate GPU detected"), so each
// rank gets an NCCL_HOSTID of its own ("<hostname>:hp-local-rank-<r>"),
// which makes NCCL treat it as a host of its own and connect the ranks
// through its socket transport, and, when the whole job is on this host,
// NCCL_SOCKET_IFNAME=lo. Variables the environment already sets are left
// alone; nothing is returned when no GPU is shared. For correctness checks
// only: the traffic goes through host memory and the ranks' kernels share
// the GPU, so it says nothing about overlap or speed.
std::vector<std::pair<std::string, std::string>> nccl_env_for_shared_gpus(
    const LaunchEnv& env, int device_count, const std::string& hostname,
    const EnvLookup& lookup = process_env);

}  // namespace hp::dist
